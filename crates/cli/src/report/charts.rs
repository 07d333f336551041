//! The charts of one run's column but its timeline (`timeline.rs`) and latencies
//! (`latency.rs`): the header every chart opens with, the downtime's parts and the passes.
//! Each draws into its own cell on the scales all runs share, its text laid out to fit, with
//! what `canvas.rs` gives every chart.

use ferry_migrate::MigrationStats;
use ferry_migrate::stats::Downtime;
use plotters::prelude::*;

use super::canvas::{
    Area, BLUE, BROWN, GREEN, HEADER_HEIGHT, LABEL_FONT, LINE_HEIGHT, ORANGE, PINK, PLOT_LEFT,
    PURPLE, RED, RIGHT_MARGIN, Scales, Swatch, UNIT_ROOM, axis_units, header, headroom, label,
};
use super::layout::{flow, text_width};

/// The downtime's parts, in order, with their colours.
pub(super) fn downtime_parts(d: &Downtime) -> [(&'static str, f64, RGBColor); 7] {
    [
        ("pause", d.pause_ms, BLUE),
        ("final sync", d.final_sync_ms, ORANGE),
        ("final pages", d.final_pages_ms, GREEN),
        ("state save", d.state_save_ms, RED),
        ("transfer", d.transfer_ms, PURPLE),
        ("load", d.load_ms, BROWN),
        ("resume", d.resume_ms, PINK),
    ]
}

/// The downtime chart's bar, its axis and margins: 4 + a 40 px plot + 30 + 10.
const DOWNTIME_BAR_HEIGHT: u32 = 84;
/// The state lines are a paragraph: set closer than the legend's rows.
const STATE_LINE_HEIGHT: i32 = 17;

/// The text under the downtime bar, laid out for a column `width` wide: each part's swatch
/// and ms, flowed into rows, then where the state's save and load went, wrapped between parts.
#[derive(Debug)]
struct DowntimeLegend {
    /// Each part's swatch position, text and colour.
    parts: Vec<(i32, i32, String, RGBColor)>,
    /// The state lines, with their left and top.
    lines: Vec<(i32, i32, String)>,
    height: u32,
}

fn downtime_legend(d: &Downtime, width: i32) -> DowntimeLegend {
    let right = width - RIGHT_MARGIN;
    let (mut x, mut y) = (PLOT_LEFT, 4);
    let mut parts = Vec::new();
    for (name, ms, color) in downtime_parts(d) {
        let text = format!("{name} {ms:.1} ms");
        let w = 18 + text_width(&text, LABEL_FONT);
        if x > PLOT_LEFT && x + w > right {
            (x, y) = (PLOT_LEFT, y + LINE_HEIGHT as i32);
        }
        parts.push((x, y, text, color));
        x += w + 18;
    }
    let mut lines = Vec::new();
    if !d.save_parts.is_empty() || !d.load_parts.is_empty() {
        // Where the state save and load went, part by part (the vCPUs summed).
        for (what, list) in [("save", &d.save_parts), ("load", &d.load_parts)] {
            let mut pieces = super::text::parts_pieces(list);
            if pieces.is_empty() {
                pieces.push("not timed by the VMM".into());
            }
            pieces[0] = format!("{what}: {}", pieces[0]);
            let indent = text_width(&format!("{what}: "), LABEL_FONT);
            let flowed = flow(&pieces, ", ", right - PLOT_LEFT, indent, LABEL_FONT);
            for (i, line) in flowed.into_iter().enumerate() {
                y += STATE_LINE_HEIGHT;
                let x = if i == 0 {
                    PLOT_LEFT
                } else {
                    PLOT_LEFT + indent
                };
                lines.push((x, y, line));
            }
        }
    }
    DowntimeLegend {
        parts,
        lines,
        height: (y + LINE_HEIGHT as i32) as u32,
    }
}

/// The height the downtime chart of `s` takes in a column `width` wide.
pub(super) fn downtime_height(s: &MigrationStats, width: u32) -> u32 {
    HEADER_HEIGHT + DOWNTIME_BAR_HEIGHT + downtime_legend(&s.downtime, width as i32).height
}

/// The downtime as one bar stacked from its parts, with a legend that gives each part's ms
/// and lines that say where the state's save and load went.
pub(super) fn downtime(area: &Area<'_>, s: &MigrationStats, sc: &Scales) -> anyhow::Result<()> {
    let area = header(
        area,
        &format!("Downtime {:.1} ms", s.downtime.total_ms),
        &[],
    )?;
    let (bar, below) = area.split_vertically(DOWNTIME_BAR_HEIGHT);
    let mut chart = ChartBuilder::on(&bar)
        .margin(10)
        .margin_top(4)
        .margin_right(24)
        .x_label_area_size(30)
        .y_label_area_size(PLOT_LEFT as u32 - 10)
        .build_cartesian_2d(0f64..headroom(sc.downtime_max_ms), 0f64..1f64)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc("ms")
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    let mut x = 0.0;
    for (_, ms, color) in downtime_parts(&s.downtime) {
        if ms > 0.0 {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(x, 0.15), (x + ms, 0.85)],
                color.filled(),
            )))?;
        }
        x += ms;
    }
    if x <= 0.0 {
        chart.draw_series(std::iter::once(Text::new(
            "no downtime: the guest was not paused",
            (headroom(sc.downtime_max_ms) * 0.02, 0.7),
            label(),
        )))?;
    }
    let legend = downtime_legend(&s.downtime, below.dim_in_pixel().0 as i32);
    for (px, py, text, color) in &legend.parts {
        below.draw(&Rectangle::new(
            [(*px, py + 2), (px + 12, py + 14)],
            color.filled(),
        ))?;
        below.draw_text(text, &label(), (px + 18, py + 1))?;
    }
    for (px, py, line) in &legend.lines {
        below.draw_text(line, &label(), (*px, py + 1))?;
    }
    Ok(())
}

/// Per pass, the MB sent (left bar, left axis) and how long it took (right bar, right axis);
/// the last, sent with the guest paused, is `final`.
pub(super) fn passes(area: &Area<'_>, s: &MigrationStats, sc: &Scales) -> anyhow::Result<()> {
    let n = sc.passes_max.max(1) as f64;
    let names: Vec<String> = s
        .passes
        .iter()
        .map(|p| {
            if p.paused {
                "final".into()
            } else {
                p.pass.to_string()
            }
        })
        .collect();
    let area = header(
        area,
        "Passes",
        &[
            ("MB sent", BLUE, Swatch::Block),
            ("duration ms", ORANGE, Swatch::Block),
        ],
    )?;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(UNIT_ROOM)
        .margin_right(16)
        .x_label_area_size(36)
        .y_label_area_size(58)
        .right_y_label_area_size(62)
        .build_cartesian_2d(-0.6f64..n - 0.4, 0f64..headroom(sc.pass_mb_max))?
        .set_secondary_coord(-0.6f64..n - 0.4, 0f64..headroom(sc.pass_ms_max));
    let label_of = |v: &f64| {
        let i = v.round();
        if (v - i).abs() > 1e-6 || i < 0.0 {
            return String::new();
        }
        names.get(i as usize).cloned().unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(sc.passes_max.clamp(1, 24))
        .x_label_formatter(&label_of)
        .x_desc("pass")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .draw()?;
    axis_units(&area, chart.plotting_area(), "MB", Some("ms"))?;
    let at = |i: usize| i as f64;
    chart.draw_series(s.passes.iter().enumerate().map(|(i, p)| {
        Rectangle::new(
            [(at(i) - 0.38, 0.0), (at(i), p.bytes as f64 / 1e6)],
            BLUE.filled(),
        )
    }))?;
    chart.draw_secondary_series(s.passes.iter().enumerate().map(|(i, p)| {
        Rectangle::new(
            [(at(i), 0.0), (at(i) + 0.38, p.duration_ms)],
            ORANGE.filled(),
        )
    }))?;
    Ok(())
}
