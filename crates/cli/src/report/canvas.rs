//! What every chart of `ferry report` draws with, below the charts and the picture that
//! arranges them: the drawing area, the scales all runs share, fonts, colours, the sizes of a
//! chart's frame, and the header with its legend.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::layout::text_width;

/// A drawing area on the SVG being written.
pub(super) type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

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
    /// Some run has a postcopy phase: every column's timeline legend then names its band.
    pub postcopy: bool,
    /// Some run's postcopy was paused by a broken connection: likewise.
    pub broken: bool,
    /// The postcopy latency buckets, lowest and highest, that any run counted requests in.
    pub latency_buckets: Option<(usize, usize)>,
    pub latency_count_max: u64,
    /// The longest total any run's prediction or run took, ms; 0 when no run has a
    /// prediction (no prediction chart then).
    pub predicted_ms_max: f64,
}

pub(super) const PAGE_SIZE: f64 = 4096.0;
/// Matplotlib's "tab10" colours: distinct, and distinct to most colour-blind readers.
pub(super) const BLUE: RGBColor = RGBColor(31, 119, 180);
pub(super) const ORANGE: RGBColor = RGBColor(255, 127, 14);
pub(super) const GREEN: RGBColor = RGBColor(44, 160, 44);
pub(super) const RED: RGBColor = RGBColor(214, 39, 40);
pub(super) const PURPLE: RGBColor = RGBColor(148, 103, 189);
pub(super) const BROWN: RGBColor = RGBColor(140, 86, 75);
pub(super) const PINK: RGBColor = RGBColor(227, 119, 194);
pub(super) const GREY: RGBColor = RGBColor(127, 127, 127);
pub(super) const TEAL: RGBColor = RGBColor(23, 190, 207);
/// The strip above a chart holding its title and the first row of its legend.
pub(super) const HEADER_HEIGHT: u32 = 30;
/// Each further row of a legend or line of text: a 13 px label and its spacing.
pub(super) const LINE_HEIGHT: u32 = 20;
/// Where a chart's plot, and the text under it, start: past the left axis's labels.
pub(super) const PLOT_LEFT: i32 = 68;
/// Room kept free at a column's right edge.
pub(super) const RIGHT_MARGIN: i32 = 12;

/// Headroom above the largest value so the top of a line or bar is not on the frame.
pub(super) fn headroom(max: f64) -> f64 {
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
    /// A translucent band, as the timeline's spans are drawn.
    Band,
}

/// A legend entry: its name, colour and swatch.
pub(super) type Entry<'a> = (&'a str, RGBColor, Swatch);

/// Where each legend entry of a chart `width` wide goes: after the title on its first row,
/// under the first entry on the rows after.
fn legend_rows<'a, 'b>(
    title: &str,
    entries: &'b [Entry<'a>],
    width: i32,
) -> Vec<(i32, i32, &'b Entry<'a>)> {
    let left = 14 + text_width(title, CAPTION_FONT) + 24;
    let (mut x, mut row) = (left, 0);
    let mut out = Vec::new();
    for entry in entries {
        let w = 22 + text_width(entry.0, LABEL_FONT);
        if x > left && x + w > width - RIGHT_MARGIN {
            (x, row) = (left, row + 1);
        }
        out.push((x, row, entry));
        x += w + 16;
    }
    out
}

/// A chart's title with its legend after it, in as many rows as the width takes, above the
/// plot where no line or bar can hide under it; returns the area left for the plot.
pub(super) fn header<'a>(
    area: &Area<'a>,
    title: &str,
    entries: &[Entry<'_>],
) -> anyhow::Result<Area<'a>> {
    let width = area.dim_in_pixel().0 as i32;
    let placed = legend_rows(title, entries, width);
    let rows = placed.last().map_or(0, |p| p.1) as u32;
    let (top, rest) = area.split_vertically(HEADER_HEIGHT + rows * LINE_HEIGHT);
    top.draw_text(title, &caption(), (14, 8))?;
    for &(x, row, &(name, color, swatch)) in &placed {
        let y = 15 + row * LINE_HEIGHT as i32;
        match swatch {
            Swatch::Line => top.draw(&PathElement::new(
                [(x, y), (x + 18, y)],
                color.stroke_width(3),
            ))?,
            Swatch::Block => top.draw(&Rectangle::new(
                [(x + 3, y - 6), (x + 15, y + 6)],
                color.filled(),
            ))?,
            Swatch::Band => top.draw(&Rectangle::new(
                [(x, y - 7), (x + 18, y + 7)],
                color.mix(0.3).filled(),
            ))?,
        }
        top.draw_text(name, &label(), (x + 22, y - 6))?;
    }
    Ok(rest)
}

/// Room above a chart's plot for its vertical axes' units.
pub(super) const UNIT_ROOM: u32 = 18;

/// The units of a chart's vertical axes, level above them (left of the left axis, right of
/// the right one), where a chart of plotters would write them turned a quarter: rotated text
/// ImageMagick's renderer turns the wrong way and does not anchor (`portable.rs`).
pub(super) fn axis_units<C: CoordTranslate>(
    area: &Area<'_>,
    plot: &DrawingArea<SVGBackend<'_>, C>,
    left: &str,
    right: Option<&str>,
) -> anyhow::Result<()> {
    let (ax, ay) = area.get_base_pixel();
    let (px, py) = plot.get_base_pixel();
    let (width, _) = plot.dim_in_pixel();
    let (x, y) = (px - ax, py - ay - UNIT_ROOM as i32 + 2);
    let style = |h| label().pos(Pos::new(h, VPos::Top));
    area.draw_text(left, &style(HPos::Right), (x - 4, y))?;
    if let Some(right) = right {
        area.draw_text(right, &style(HPos::Left), (x + width as i32 + 4, y))?;
    }
    Ok(())
}
