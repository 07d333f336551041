//! Showing a migration: live progress (`live.rs`), the statistics as text (`text.rs`, with the
//! prediction's line and table from `predicted.rs`), and
//! `ferry report`, which draws statistics written with `--stats-out` (with a copied disk's
//! figures beside them under `disk`, where `GET /migration` shows them) as SVG charts
//! (`plot.rs` arranges `timeline.rs`, `charts.rs`, `latency.rs` and `prediction.rs`, which draw with
//! `canvas.rs`, their text fitted by `layout.rs`, the SVG made one that every renderer draws
//! alike by `portable.rs`),
//! alone or side by side. `drawn.rs` tests what is drawn for every kind of run
//! (`fixtures.rs`), read back from the SVG.

mod canvas;
mod charts;
#[cfg(test)]
mod drawn;
#[cfg(test)]
mod fixtures;
mod latency;
mod layout;
mod live;
mod plot;
mod portable;
mod predicted;
mod prediction;
mod text;
mod timeline;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use ferry_migrate::MigrationStats;
use ferry_vmm::disk_copy::DiskCopyStatus;

pub use live::{Live, PlainLines};
pub use plot::Run;
pub use text::{
    disk_copy_line, downtime_parts, phase_name, print_local_table, print_partial, print_table,
    progress_line,
};

use crate::exit::UsageError;

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Statistics written by `--stats-out` (or a `GET /migration` answer, or a `ferry bench`
    /// JSON row); several are drawn side by side on shared scales.
    #[arg(required = true, value_name = "STATS.json")]
    inputs: Vec<PathBuf>,
    /// The picture: `.svg`, or `.html` for a self-contained page embedding it.
    #[arg(short, long, value_name = "OUT.svg|OUT.html")]
    output: PathBuf,
}

/// What `-o` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Svg,
    Html,
}

pub fn report(args: &ReportArgs) -> anyhow::Result<ExitCode> {
    let format = match args.output.extension().and_then(|e| e.to_str()) {
        Some("svg") => Format::Svg,
        Some("html" | "htm") => Format::Html,
        _ => {
            return Err(UsageError(format!(
                "-o {}: write to a .svg or .html file",
                args.output.display()
            ))
            .into());
        }
    };
    let runs = args
        .inputs
        .iter()
        .map(|path| load(path))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let svg = plot::render(&runs)?;
    let body = match format {
        Format::Svg => svg,
        Format::Html => html(&runs, &svg),
    };
    std::fs::write(&args.output, body)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    eprintln!("ferry: wrote {}", args.output.display());
    Ok(ExitCode::SUCCESS)
}

/// Reads one run's statistics, named after its file.
fn load(path: &Path) -> anyhow::Result<Run> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    // Statistics themselves, or something that carries them under "stats".
    let stats = match value.get("stats") {
        Some(inner) if inner.is_object() => inner.clone(),
        _ => value.clone(),
    };
    let stats: MigrationStats = serde_json::from_value(stats).with_context(|| {
        format!(
            "{} holds no migration statistics; write them with `ferry migrate --stats-out`",
            path.display()
        )
    })?;
    // A copied disk's figures, beside the statistics in a file and in a GET /migration
    // answer alike.
    let disk = match value.get("disk") {
        Some(disk) => Some(
            serde_json::from_value(disk.clone())
                .with_context(|| format!("{}: unreadable disk copy figures", path.display()))?,
        ),
        None => None,
    };
    let name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into(),
    );
    Ok(Run { name, stats, disk })
}

/// A run's statistics as JSON: the engine's, with a copied disk's figures under `disk`.
fn stats_json(stats: &MigrationStats, disk: Option<&DiskCopyStatus>) -> serde_json::Value {
    let mut json = serde_json::to_value(stats).unwrap_or_default();
    if let (Some(disk), Some(map)) = (disk, json.as_object_mut()) {
        map.insert(
            "disk".into(),
            serde_json::to_value(disk).unwrap_or_default(),
        );
    }
    json
}

/// Writes `stats`, and a copied disk's figures, as JSON for `ferry report`.
pub fn write_stats(
    path: &Path,
    stats: &MigrationStats,
    disk: Option<&DiskCopyStatus>,
) -> anyhow::Result<()> {
    let json = stats_json(stats, disk).to_string();
    std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))
}

/// Prints `stats`, and a copied disk's figures, as one JSON line without the timeline.
pub fn print_json(stats: &MigrationStats, disk: Option<&DiskCopyStatus>) {
    let mut line = stats_json(stats, disk);
    if let Some(map) = line.as_object_mut() {
        map.remove("timeline");
    }
    println!("{line}");
}

/// Draws one benchmark scenario's migration to `dir/<scenario>.svg` (`ferry bench --report`).
pub fn write_scenario_svg(
    dir: &Path,
    scenario: &str,
    stats: &MigrationStats,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{}.svg", slug(scenario)));
    let run = Run {
        name: scenario.to_string(),
        stats: stats.clone(),
        disk: None,
    };
    std::fs::write(&path, plot::render(&[run])?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("ferry: wrote {}", path.display());
    Ok(())
}

/// A self-contained page: the SVG inline, the runs' names as its title.
fn html(runs: &[Run], svg: &str) -> String {
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let title = escape(&format!("ferry report: {}", names.join(" vs ")));
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>{title}</title></head>\n<body style=\"margin:0;background:#fff\">\n{}\n</body>\n</html>\n",
        svg.trim_start_matches(|c: char| c != '<')
            .trim_start_matches("<?xml version=\"1.0\" encoding=\"UTF-8\"?>")
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A file name for a scenario: lower-case letters, digits and dashes.
pub fn slug(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_written_with_page_latencies_us_still_load() {
        // Written before the field went: it was always empty (postcopy's latencies are in
        // postcopy.latency_buckets), and serde skips a field the type no longer has.
        let stats = super::fixtures::postcopy();
        let mut json = serde_json::to_value(&stats).unwrap();
        json["page_latencies_us"] = serde_json::json!([]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let run = load(&path).unwrap();
        assert_eq!(
            (run.name.as_str(), run.stats, run.disk),
            ("old", stats, None)
        );
    }

    #[test]
    fn a_copied_disks_figures_go_into_the_statistics_file_and_come_back() {
        let (stats, disk) = (super::fixtures::precopy(), super::fixtures::disk_copy());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("with-disk.json");
        write_stats(&path, &stats, Some(&disk)).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(written["disk"]["stats"]["dirty_passes"], 3, "{written}");
        assert_eq!(written["disk"]["writers_held_ms"], 40.2, "{written}");
        let run = load(&path).unwrap();
        assert_eq!((run.stats, run.disk), (stats, Some(disk)));
    }

    #[test]
    fn a_migration_answer_with_a_disk_loads_its_disk_too() {
        // GET /migration: the statistics under "stats", the disk beside them.
        let answer = serde_json::json!({
            "phase": "completed",
            "stats": super::fixtures::precopy(),
            "disk": super::fixtures::disk_copy(),
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("answer.json");
        std::fs::write(&path, answer.to_string()).unwrap();
        assert_eq!(
            load(&path).unwrap().disk,
            Some(super::fixtures::disk_copy())
        );
    }

    #[test]
    fn scenario_names_become_file_names() {
        assert_eq!(slug("1G ws @ 100 MB/s, 300 ms"), "1g-ws-100-mb-s-300-ms");
        assert_eq!(slug("64G, 256M touched"), "64g-256m-touched");
    }
}
