//! `ferry report`'s picture: one column per run, each with a title, the timeline, the downtime
//! bar, the per-pass bars and (when any run has postcopy page latencies) their histogram. Runs
//! side by side share every scale, so a longer bar is a larger figure.

use ferry_migrate::MigrationStats;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{charts, latency};

/// One migration to draw, named (by its file, or its benchmark scenario).
#[derive(Clone, Debug)]
pub struct Run {
    pub name: String,
    pub stats: MigrationStats,
}

/// A drawing area on the SVG being written.
pub(super) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// A column wide enough for a timeline of a few hundred samples and the downtime legend's
/// seven parts on two lines.
const COLUMN_WIDTH: u32 = 760;
/// Heights, in pixels, of the rows of a column: title, timeline, downtime, passes, latency.
const TITLE_HEIGHT: u32 = 56;
const TIMELINE_HEIGHT: u32 = 360;
const DOWNTIME_HEIGHT: u32 = 170;
const PASSES_HEIGHT: u32 = 280;
const LATENCY_HEIGHT: u32 = 260;
/// Font sizes (px): large enough to read at the picture's natural size.
pub(super) const TITLE_FONT: u32 = 22;
pub(super) const CAPTION_FONT: u32 = 17;
pub(super) const LABEL_FONT: u32 = 13;

/// The largest figure of each kind over all runs: the shared scales.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Scales {
    pub t_max_s: f64,
    pub mb_max: f64,
    pub rate_max_mb_s: f64,
    pub downtime_max_ms: f64,
    pub passes_max: usize,
    pub pass_mb_max: f64,
    pub pass_ms_max: f64,
    pub latency_max_us: f64,
}

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
                    .max(charts::dirty_mb_s(x.dirty_rate_pages_per_s));
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
            for &l in &st.page_latencies_us {
                s.latency_max_us = s.latency_max_us.max(l);
            }
        }
        s
    }
}

/// Draws `runs` side by side and returns the SVG document.
pub fn render(runs: &[Run]) -> anyhow::Result<String> {
    anyhow::ensure!(!runs.is_empty(), "no runs to draw");
    let scales = Scales::of(runs);
    let latencies = runs.iter().any(|r| !r.stats.page_latencies_us.is_empty());
    let mut rows = vec![
        TITLE_HEIGHT,
        TIMELINE_HEIGHT,
        DOWNTIME_HEIGHT,
        PASSES_HEIGHT,
    ];
    if latencies {
        rows.push(LATENCY_HEIGHT);
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
            charts::timeline(&cells[1], &run.stats, &scales)?;
            charts::downtime(&cells[2], &run.stats, &scales)?;
            charts::passes(&cells[3], &run.stats, &scales)?;
            if latencies {
                latency::histogram(&cells[4], &run.stats, &scales)?;
            }
        }
        root.present()?;
    }
    Ok(svg)
}

/// The run's name and its headline figures.
fn title(area: &Area<'_>, run: &Run) -> anyhow::Result<()> {
    let s = &run.stats;
    area.draw_text(
        &run.name,
        &("sans-serif", TITLE_FONT)
            .into_font()
            .style(FontStyle::Bold)
            .color(&BLACK),
        (14, 8),
    )?;
    let summary = format!(
        "total {:.0} ms · downtime {:.1} ms · {:.1} MB sent at {:.0} MB/s · {} passes · {}",
        s.total_ms,
        s.downtime.total_ms,
        s.bytes_sent as f64 / 1e6,
        s.bandwidth_mb_s,
        s.passes.len(),
        if s.converged {
            "converged"
        } else {
            "forced switchover"
        }
    );
    area.draw_text(
        &summary,
        &("sans-serif", LABEL_FONT + 1)
            .into_font()
            .color(&BLACK.mix(0.75)),
        (14, 34),
    )?;
    Ok(())
}
