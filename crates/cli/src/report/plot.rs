//! `ferry report`'s picture: one column per run, each with a title, the timeline, the downtime
//! bar, the per-pass bars, (when any run has postcopy page requests) their latencies and (when
//! any run has a prediction) the total each pass end predicted against the actual. Runs
//! side by side share every scale, so a longer bar is a larger figure, and every row is as
//! tall as the tallest of its cells, so that the charts of the runs line up.

use ferry_migrate::MigrationStats;
use ferry_vmm::disk_copy::DiskCopyStatus;
use plotters::prelude::*;

use super::canvas::{Area, LABEL_FONT, LINE_HEIGHT, Scales, TITLE_FONT, dirty_mb_s};
use super::layout::{flow, truncate};
use super::timeline::spans;
use super::{charts, latency, prediction, timeline};

/// One migration to draw, named (by its file, or its benchmark scenario), with its copied
/// disk's figures if it copied one.
#[derive(Clone, Debug)]
pub struct Run {
    pub name: String,
    pub stats: MigrationStats,
    pub disk: Option<DiskCopyStatus>,
}

/// A column wide enough for a timeline of a few hundred samples and the downtime legend's
/// seven parts on two lines.
pub(super) const COLUMN_WIDTH: u32 = 760;
/// Heights, in pixels, of the rows of a column whose content does not set them: timeline,
/// passes, latency (the title and the downtime grow with their lines of text).
const TIMELINE_HEIGHT: u32 = 360;
const PASSES_HEIGHT: u32 = 280;
const LATENCY_HEIGHT: u32 = 260;
const PREDICTION_HEIGHT: u32 = 240;
/// Room left free at a column's left and right edges, so that two columns' text never meet.
const SIDE_MARGIN: i32 = 14;
impl Scales {
    fn of(runs: &[Run]) -> Scales {
        let mut s = Scales::default();
        for r in runs {
            let st = &r.stats;
            s.t_max_s = s.t_max_s.max(st.total_ms / 1000.0);
            for x in &st.timeline {
                s.t_max_s = s.t_max_s.max(x.t_ms / 1000.0);
                s.mb_max = s
                    .mb_max
                    .max(x.bytes_sent.max(x.remaining_bytes) as f64 / 1e6);
                s.rate_max_mb_s = s
                    .rate_max_mb_s
                    .max(x.send_rate_mb_s)
                    .max(dirty_mb_s(x.dirty_rate_pages_per_s));
            }
            s.downtime_max_ms = s.downtime_max_ms.max(st.downtime.total_ms).max(
                charts::downtime_parts(&st.downtime)
                    .iter()
                    .map(|p| p.1)
                    .sum(),
            );
            s.passes_max = s.passes_max.max(st.passes.len());
            for p in &st.passes {
                s.pass_mb_max = s.pass_mb_max.max(p.bytes as f64 / 1e6);
                s.pass_ms_max = s.pass_ms_max.max(p.duration_ms);
            }
            let predicted = prediction::predicted_totals(st);
            if !predicted.is_empty() {
                s.predicted_ms_max = predicted
                    .iter()
                    .map(|p| p.1)
                    .fold(s.predicted_ms_max.max(st.total_ms), f64::max);
            }
            let spans = spans(st);
            s.postcopy |= spans.postcopy.is_some();
            s.broken |= !spans.broken.is_empty();
            let buckets = st.postcopy.as_ref().map_or(&[][..], |p| &p.latency_buckets);
            for (k, &count) in buckets.iter().enumerate().filter(|b| *b.1 > 0) {
                let (lo, hi) = s.latency_buckets.unwrap_or((k, k));
                s.latency_buckets = Some((lo.min(k), hi.max(k)));
                s.latency_count_max = s.latency_count_max.max(count);
            }
        }
        s
    }
}

/// Draws `runs` side by side and returns the SVG document.
pub fn render(runs: &[Run]) -> anyhow::Result<String> {
    anyhow::ensure!(!runs.is_empty(), "no runs to draw");
    let scales = Scales::of(runs);
    let tallest = |height: &dyn Fn(&Run) -> u32| runs.iter().map(height).max().unwrap_or(0);
    let mut rows = vec![
        tallest(&title_height),
        TIMELINE_HEIGHT,
        tallest(&|r| charts::downtime_height(&r.stats, COLUMN_WIDTH)),
        PASSES_HEIGHT,
    ];
    if scales.latency_buckets.is_some() {
        rows.push(LATENCY_HEIGHT);
    }
    if scales.predicted_ms_max > 0.0 {
        rows.push(PREDICTION_HEIGHT);
    }
    let height: u32 = rows.iter().sum();
    let width = COLUMN_WIDTH * runs.len() as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let columns = root.split_evenly((1, runs.len()));
        for (column, run) in columns.iter().zip(runs) {
            let breaks: Vec<i32> = rows
                .iter()
                .scan(0, |y, h| {
                    *y += *h as i32;
                    Some(*y)
                })
                .take(rows.len() - 1)
                .collect();
            let cells = column.split_by_breakpoints([] as [i32; 0], breaks);
            title(&cells[0], run)?;
            timeline::timeline(&cells[1], &run.stats, &scales)?;
            charts::downtime(&cells[2], &run.stats, &scales)?;
            charts::passes(&cells[3], &run.stats, &scales)?;
            let mut next = 4;
            if scales.latency_buckets.is_some() {
                latency::histogram(&cells[next], &run.stats, &scales)?;
                next += 1;
            }
            if scales.predicted_ms_max > 0.0 {
                prediction::chart(&cells[next], &run.stats, &scales)?;
            }
        }
        root.present()?;
    }
    Ok(super::portable::portable(&svg))
}

/// How a run ended, in a few words: converged, forced, postcopy and why, cancelled or failed
/// and where (the timeline's last mark says; a run's postcopy statistics exist only once its
/// postcopy completed).
fn outcome(s: &MigrationStats) -> String {
    use ferry_migrate::Phase::{Cancelled, Failed};
    let last = s.timeline.last();
    let pass = last.map_or(0, |x| x.pass);
    let during = s
        .timeline
        .iter()
        .rev()
        .map(|x| x.phase)
        .find(|p| !matches!(p, Cancelled | Failed))
        .map_or("setup".into(), |p| {
            super::text::phase_name(p).replace('_', " ")
        });
    let postcopy = s.postcopy.as_ref();
    let mut out = match (last.map(|x| x.phase), postcopy) {
        (Some(Cancelled), _) => format!("cancelled in pass {pass}"),
        (Some(Failed), _) => format!("failed in {during}"),
        (_, Some(pc)) => format!(
            "postcopy after pass {} ({})",
            pc.after_passes,
            super::text::trigger_name(pc.trigger)
        ),
        (_, None) if s.converged => "converged".into(),
        (_, None) => "forced switchover".into(),
    };
    if let Some(pc) = postcopy.filter(|pc| pc.recoveries > 0) {
        out += &format!(
            ", recovered {}× after {:.0} ms paused",
            pc.recoveries, pc.paused_ms
        );
    }
    out
}

/// The title's second line, in pieces: the headline figures, how the run ended, and a copied
/// disk's figures.
fn summary(run: &Run) -> Vec<String> {
    let s = &run.stats;
    let mut pieces = vec![
        format!("total {:.0} ms", s.total_ms),
        format!("downtime {:.1} ms", s.downtime.total_ms),
        format!(
            "{:.1} MB sent at {:.0} MB/s",
            s.bytes_sent as f64 / 1e6,
            s.bandwidth_mb_s
        ),
        match s.passes.len() {
            1 => "1 pass".into(),
            n => format!("{n} passes"),
        },
        outcome(s),
    ];
    if s.throttle_max_percent > 0 {
        pieces.push(format!("throttled up to {}%", s.throttle_max_percent));
    }
    if s.throttle_unsupported {
        pieces.push("auto-converge unsupported by the VMM".into());
    }
    if let Some(disk) = &run.disk {
        let mut disk = super::text::disk_copy_pieces(disk);
        disk[0].insert_str(0, "disk copy: ");
        pieces.extend(disk);
    }
    pieces
}

/// The run's name (cut to the column) and its summary flowed into lines.
fn title_lines(run: &Run) -> (String, Vec<String>) {
    let width = COLUMN_WIDTH as i32 - 2 * SIDE_MARGIN;
    (
        truncate(&run.name, width, TITLE_FONT),
        flow(&summary(run), " · ", width, 0, SUMMARY_FONT),
    )
}

/// The summary's font: a label's, one px larger.
const SUMMARY_FONT: u32 = LABEL_FONT + 1;
/// The title's first line: 8 px above a 22 px name and its descent.
const NAME_HEIGHT: u32 = 34;

fn title_height(run: &Run) -> u32 {
    NAME_HEIGHT + title_lines(run).1.len() as u32 * LINE_HEIGHT + 8
}

/// The run's name and its headline figures.
fn title(area: &Area<'_>, run: &Run) -> anyhow::Result<()> {
    let (name, lines) = title_lines(run);
    area.draw_text(
        &name,
        &("sans-serif", TITLE_FONT)
            .into_font()
            .style(FontStyle::Bold)
            .color(&BLACK),
        (SIDE_MARGIN, 8),
    )?;
    for (i, line) in lines.iter().enumerate() {
        area.draw_text(
            line,
            &("sans-serif", SUMMARY_FONT)
                .into_font()
                .color(&BLACK.mix(0.75)),
            (
                SIDE_MARGIN,
                NAME_HEIGHT as i32 + i as i32 * LINE_HEIGHT as i32,
            ),
        )?;
    }
    Ok(())
}
