//! The charts of one run's column: the timeline, the downtime's parts, the passes and the
//! postcopy page latencies. Each draws into its own cell on the scales all runs share.

use ferry_migrate::Phase;
use ferry_migrate::stats::{Downtime, Sample};
use plotters::chart::DualCoordChartContext;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::plot::{Area, CAPTION_FONT, LABEL_FONT, Scales};

const PAGE_SIZE: f64 = 4096.0;
/// Matplotlib's "tab10" colours: distinct, and distinct to most colour-blind readers.
pub(super) const BLUE: RGBColor = RGBColor(31, 119, 180);
const ORANGE: RGBColor = RGBColor(255, 127, 14);
const GREEN: RGBColor = RGBColor(44, 160, 44);
const RED: RGBColor = RGBColor(214, 39, 40);
const PURPLE: RGBColor = RGBColor(148, 103, 189);
const BROWN: RGBColor = RGBColor(140, 86, 75);
const PINK: RGBColor = RGBColor(227, 119, 194);
const GREY: RGBColor = RGBColor(127, 127, 127);
/// The strip above a chart holding its title and legend.
const HEADER_HEIGHT: u32 = 30;

/// Headroom above the largest value so the top of a line or bar is not on the frame.
fn headroom(max: f64) -> f64 {
    if max > 0.0 { max * 1.1 } else { 1.0 }
}

pub(super) fn dirty_mb_s(pages_per_s: f64) -> f64 {
    pages_per_s * PAGE_SIZE / 1e6
}

pub(super) fn caption() -> TextStyle<'static> {
    ("sans-serif", CAPTION_FONT).into_font().color(&BLACK)
}

pub(super) fn label() -> TextStyle<'static> {
    ("sans-serif", LABEL_FONT).into_font().color(&BLACK)
}

/// How a legend entry is drawn.
#[derive(Clone, Copy, Debug)]
pub(super) enum Swatch {
    Line,
    Block,
}

/// A chart's title with its legend after it on one line, above the plot where no line or bar
/// can hide under it; returns the area left for the plot.
pub(super) fn header<'a>(
    area: &Area<'a>,
    title: &str,
    entries: &[(&str, RGBColor, Swatch)],
) -> anyhow::Result<Area<'a>> {
    let (top, rest) = area.split_vertically(HEADER_HEIGHT);
    top.draw_text(title, &caption(), (14, 8))?;
    let mut x = 14 + text_width(title, CAPTION_FONT) + 24;
    for &(name, color, swatch) in entries {
        let y = 15;
        match swatch {
            Swatch::Line => top.draw(&PathElement::new(
                [(x, y), (x + 18, y)],
                color.stroke_width(3),
            ))?,
            Swatch::Block => top.draw(&Rectangle::new(
                [(x + 3, y - 6), (x + 15, y + 6)],
                color.filled(),
            ))?,
        }
        top.draw_text(name, &label(), (x + 22, y - 6))?;
        x += 22 + text_width(name, LABEL_FONT) + 16;
    }
    Ok(rest)
}

/// Estimated width in pixels of `text` at `font` px: plotters' own estimate for fonts it cannot
/// measure (0.7 em a character, the em being the size / 1.24²), which suits sans-serif.
fn text_width(text: &str, font: u32) -> i32 {
    (f64::from(font) / 1.24 / 1.24 * 0.7 * text.chars().count() as f64).round() as i32
}

/// Bytes sent and dirty bytes remaining (MB, left axis), send and dirty rate (MB/s, right
/// axis) over time, with each pass's start and the switchover marked.
pub(super) fn timeline(
    area: &Area<'_>,
    s: &ferry_migrate::MigrationStats,
    sc: &Scales,
) -> anyhow::Result<()> {
    let t_max = headroom(sc.t_max_s);
    let area = header(
        area,
        "Timeline",
        &[
            ("sent MB", BLUE, Swatch::Line),
            ("dirty remaining MB", ORANGE, Swatch::Line),
            ("send MB/s", GREEN, Swatch::Line),
            ("dirty MB/s", PURPLE, Swatch::Line),
        ],
    )?;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(4)
        .margin_right(16)
        .x_label_area_size(36)
        .y_label_area_size(58)
        .right_y_label_area_size(62)
        .build_cartesian_2d(0f64..t_max, 0f64..headroom(sc.mb_max))?
        .set_secondary_coord(0f64..t_max, 0f64..headroom(sc.rate_max_mb_s));
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("MB")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("MB/s")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .draw()?;
    let t = |x: &Sample| x.t_ms / 1000.0;
    if s.timeline.is_empty() {
        chart.draw_series(std::iter::once(Text::new(
            "no timeline in these statistics",
            (t_max * 0.3, headroom(sc.mb_max) * 0.5),
            label(),
        )))?;
        return Ok(());
    }
    marks(&mut chart, &s.timeline, sc)?;
    // Rates first and thinner, so the byte counts read on top of them.
    let rates: [Series; 2] = [
        (GREEN, |x| x.send_rate_mb_s),
        (PURPLE, |x| dirty_mb_s(x.dirty_rate_pages_per_s)),
    ];
    for (color, y) in rates {
        let points = s.timeline.iter().map(|x| (t(x), y(x)));
        chart.draw_secondary_series(LineSeries::new(points, color.stroke_width(1)))?;
    }
    let lines: [Series; 2] = [
        (BLUE, |x| x.bytes_sent as f64 / 1e6),
        (ORANGE, |x| x.remaining_bytes as f64 / 1e6),
    ];
    for (color, y) in lines {
        let points = s.timeline.iter().map(|x| (t(x), y(x)));
        chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?;
    }
    Ok(())
}

/// A line of the timeline: its colour and its value at a sample.
type Series = (RGBColor, fn(&Sample) -> f64);

type Axis = plotters::coord::types::RangedCoordf64;
type TimeChart<'a, 'b> =
    DualCoordChartContext<'a, SVGBackend<'b>, Cartesian2d<Axis, Axis>, Cartesian2d<Axis, Axis>>;

/// Grey lines where passes start (numbered where there is room) and a red band from the
/// switchover (the guest paused) to the end.
fn marks(chart: &mut TimeChart<'_, '_>, timeline: &[Sample], sc: &Scales) -> anyhow::Result<()> {
    let top = headroom(sc.mb_max);
    let t_max = headroom(sc.t_max_s);
    // Labels closer than 3% of the axis (about 20 px) would overlap: skip them.
    let min_gap = t_max * 0.03;
    let mut last_label = f64::NEG_INFINITY;
    for w in timeline.windows(2) {
        let (before, at) = (&w[0], &w[1]);
        let x = at.t_ms / 1000.0;
        if at.phase == Phase::Switchover && before.phase != Phase::Switchover {
            let end = timeline.last().map_or(x, |l| l.t_ms / 1000.0);
            let band = Rectangle::new(
                [(x, 0.0), (end.max(x + t_max * 0.002), top)],
                RED.mix(0.15).filled(),
            );
            chart.draw_series(std::iter::once(band))?;
            chart.draw_series(std::iter::once(PathElement::new(
                [(x, 0.0), (x, top)],
                RED.stroke_width(2),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                "switchover",
                // Below the pass numbers' row, so the two never overlap.
                (x, top * 0.92),
                label().color(&RED).pos(Pos::new(HPos::Right, VPos::Top)),
            )))?;
            last_label = x;
        } else if at.pass != before.pass && at.phase == Phase::Precopy {
            chart.draw_series(std::iter::once(PathElement::new(
                [(x, 0.0), (x, top)],
                GREY.mix(0.45),
            )))?;
            if x - last_label >= min_gap {
                chart.draw_series(std::iter::once(Text::new(
                    format!("{}", at.pass),
                    (x, top * 0.99),
                    label().color(&GREY).pos(Pos::new(HPos::Left, VPos::Top)),
                )))?;
                last_label = x;
            }
        }
    }
    Ok(())
}

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

/// The downtime as one bar stacked from its parts, with a legend that gives each part's ms.
pub(super) fn downtime(
    area: &Area<'_>,
    s: &ferry_migrate::MigrationStats,
    sc: &Scales,
) -> anyhow::Result<()> {
    let area = header(
        area,
        &format!("Downtime {:.1} ms", s.downtime.total_ms),
        &[],
    )?;
    let d = &s.downtime;
    let parts = !d.save_parts.is_empty() || !d.load_parts.is_empty();
    let legend_height = if parts { 96 } else { 52 };
    let (bar, legend) = area.split_vertically(area.dim_in_pixel().1 - legend_height);
    let mut chart = ChartBuilder::on(&bar)
        .margin(10)
        .margin_top(4)
        .margin_right(24)
        .x_label_area_size(30)
        .y_label_area_size(58)
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
    // The legend, flowed into lines by the text's estimated width.
    let (width, _) = legend.dim_in_pixel();
    let (mut px, mut py) = (68i32, 4i32);
    for (name, ms, color) in downtime_parts(&s.downtime) {
        let text = format!("{name} {ms:.1} ms");
        let w = 18 + text_width(&text, LABEL_FONT) + 18;
        if px + w > width as i32 - 10 {
            px = 68;
            py += 22;
        }
        legend.draw(&Rectangle::new(
            [(px, py + 2), (px + 12, py + 14)],
            color.filled(),
        ))?;
        legend.draw_text(&text, &label(), (px + 18, py + 1))?;
        px += w;
    }
    if parts {
        // Where the state save and load went, part by part (the vCPUs summed).
        for (what, list) in [("save", &d.save_parts), ("load", &d.load_parts)] {
            py += 22;
            let line = format!("{what}: {}", super::text::parts_summary(list));
            legend.draw_text(&line, &label(), (68, py + 1))?;
        }
    }
    Ok(())
}

/// Per pass, the MB sent (left bar, left axis) and how long it took (right bar, right axis);
/// the last, sent with the guest paused, is `final`.
pub(super) fn passes(
    area: &Area<'_>,
    s: &ferry_migrate::MigrationStats,
    sc: &Scales,
) -> anyhow::Result<()> {
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
        .margin_top(4)
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
        .y_desc("MB")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("ms")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .draw()?;
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
