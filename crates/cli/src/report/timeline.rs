//! The timeline chart: bytes sent and remaining, send and dirty rates over time, each pass's
//! start, and where the guest was: paused (the downtime), running on the destination while
//! postcopy fetched its pages, waiting on a broken postcopy connection.

use ferry_migrate::stats::Sample;
use ferry_migrate::{MigrationStats, Phase};
use plotters::chart::DualCoordChartContext;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::canvas::{
    Area, BLUE, GREEN, GREY, LABEL_FONT, ORANGE, PURPLE, RED, Scales, Swatch, TEAL, UNIT_ROOM,
    axis_units, dirty_mb_s, header, headroom, label,
};
use super::layout::text_width;

/// Where a run's guest was over the timeline, in seconds since the migration started.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Spans {
    /// From the pause on the source to the resume on the destination: the downtime.
    pub paused: Option<(f64, f64)>,
    /// The guest runs on the destination while the source sends the pages it still needs.
    pub postcopy: Option<(f64, f64)>,
    /// Postcopy paused by a broken connection, each until a recovery resumed it.
    pub broken: Vec<(f64, f64)>,
    /// A migration that ended without the guest moving, and when: cancelled or failed.
    pub ended: Option<(Phase, f64)>,
}

/// Reads the spans off the timeline's phase marks. The source marks the switchover before it
/// pauses the guest and, in postcopy, first sends its early discards with the guest still
/// running; it marks postcopy once the destination said it resumed the guest. So a postcopy
/// run's pause is the downtime that ends at its first postcopy mark, and a precopy run's is
/// the downtime that starts at its switchover mark.
pub(super) fn spans(s: &MigrationStats) -> Spans {
    let t = |x: &Sample| x.t_ms / 1000.0;
    let Some(last) = s.timeline.last() else {
        return Spans::default();
    };
    let end = t(last);
    let first = |phase: Phase| s.timeline.iter().find(|x| x.phase == phase).map(t);
    let downtime = s.downtime.total_ms / 1000.0;
    let switchover = first(Phase::Switchover);
    let postcopy_start = s
        .timeline
        .iter()
        .find(|x| matches!(x.phase, Phase::Postcopy | Phase::PostcopyPaused))
        .map(t);
    let mut spans = Spans::default();
    if let Some(resumed) = postcopy_start {
        let from = switchover.unwrap_or(0.0).max(resumed - downtime);
        spans.paused = (downtime > 0.0).then_some((from, resumed));
        spans.postcopy = Some((resumed, end));
    } else if let Some(paused) = switchover.filter(|_| downtime > 0.0) {
        spans.paused = Some((paused, paused + downtime));
    }
    for (i, x) in s.timeline.iter().enumerate() {
        let starts = x.phase == Phase::PostcopyPaused
            && (i == 0 || s.timeline[i - 1].phase != Phase::PostcopyPaused);
        if starts {
            let until = s.timeline[i..]
                .iter()
                .find(|y| y.phase != Phase::PostcopyPaused)
                .map_or(end, t);
            spans.broken.push((t(x), until));
        }
    }
    if matches!(last.phase, Phase::Cancelled | Phase::Failed) {
        spans.ended = Some((last.phase, end));
    }
    spans
}

/// Bytes sent and dirty bytes remaining (MB, left axis), send and dirty rate (MB/s, right
/// axis) over time, with each pass's start and the guest's whereabouts marked.
pub(super) fn timeline(area: &Area<'_>, s: &MigrationStats, sc: &Scales) -> anyhow::Result<()> {
    let t_max = headroom(sc.t_max_s);
    let mut legend = vec![
        ("sent MB", BLUE, Swatch::Line),
        ("dirty remaining MB", ORANGE, Swatch::Line),
        ("send MB/s", GREEN, Swatch::Line),
        ("dirty MB/s", PURPLE, Swatch::Line),
        ("guest paused", RED, Swatch::Band),
    ];
    // Every column gets the same legend, so that the plots of runs side by side line up.
    if sc.postcopy {
        legend.push((
            "guest runs on destination, pages fetched",
            TEAL,
            Swatch::Band,
        ));
    }
    if sc.broken {
        legend.push(("postcopy paused, connection broken", GREY, Swatch::Band));
    }
    let area = header(area, "Timeline", &legend)?;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(UNIT_ROOM)
        .margin_right(16)
        .x_label_area_size(36)
        .y_label_area_size(58)
        .right_y_label_area_size(62)
        .build_cartesian_2d(0f64..t_max, 0f64..headroom(sc.mb_max))?
        .set_secondary_coord(0f64..t_max, 0f64..headroom(sc.rate_max_mb_s));
    chart
        .configure_mesh()
        .x_desc("time (s)")
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
    axis_units(&area, chart.plotting_area(), "MB", Some("MB/s"))?;
    let t = |x: &Sample| x.t_ms / 1000.0;
    if s.timeline.is_empty() {
        chart.draw_series(std::iter::once(Text::new(
            "no timeline in these statistics",
            (t_max * 0.3, headroom(sc.mb_max) * 0.5),
            label(),
        )))?;
        return Ok(());
    }
    bands(&mut chart, &spans(s), sc)?;
    pass_marks(&mut chart, &s.timeline, sc)?;
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

/// The postcopy band's label: its teal darkened to read as text.
const DARK_TEAL: RGBColor = RGBColor(16, 125, 136);

/// The shortest band drawn, as a share of the axis: a 1 ms pause on a 60 s axis still shows.
const MIN_BAND: f64 = 0.002;

/// The spans as translucent bands under the lines, each with a line and a label at its start
/// (the label left of the line when there is room, so it reads against what came before).
fn bands(chart: &mut TimeChart<'_, '_>, spans: &Spans, sc: &Scales) -> anyhow::Result<()> {
    let top = headroom(sc.mb_max);
    let t_max = headroom(sc.t_max_s);
    if let Some(span) = spans.postcopy {
        band(chart, span, TEAL.mix(0.15), sc)?;
    }
    for &span in &spans.broken {
        band(chart, span, GREY.mix(0.3), sc)?;
    }
    let mut marks = Vec::new();
    if let Some(span) = spans.paused {
        band(chart, span, RED.mix(0.25), sc)?;
        marks.push((span.0, "switchover", RED, true));
    }
    if let Some((from, _)) = spans.postcopy {
        marks.push((from, "postcopy", DARK_TEAL, false));
    }
    if let Some((phase, at)) = spans.ended {
        let name = if phase == Phase::Cancelled {
            "cancelled"
        } else {
            "failed"
        };
        marks.push((at, name, BLACK, true));
    }
    let (plot_px, _) = chart.plotting_area().dim_in_pixel();
    let px_per_s = f64::from(plot_px) / t_max;
    for (x, name, color, line) in marks {
        if line {
            chart.draw_series(std::iter::once(PathElement::new(
                [(x, 0.0), (x, top)],
                color.stroke_width(2),
            )))?;
        }
        // Left of the line when there is room (it names what starts there), else right.
        let width_s = f64::from(text_width(name, LABEL_FONT) + 4) / px_per_s;
        let before = line && x - width_s >= 0.0;
        let (h, x) = match before {
            true => (HPos::Right, x),
            false => (HPos::Left, x + 3.0 / px_per_s),
        };
        chart.draw_series(std::iter::once(Text::new(
            name,
            // Below the pass numbers' row, so the two never overlap.
            (x, top * 0.92),
            label().color(&color).pos(Pos::new(h, VPos::Top)),
        )))?;
    }
    Ok(())
}

/// A translucent band from `from` to `to` over the whole height of the plot.
fn band(
    chart: &mut TimeChart<'_, '_>,
    (from, to): (f64, f64),
    color: RGBAColor,
    sc: &Scales,
) -> anyhow::Result<()> {
    let to = to.max(from + headroom(sc.t_max_s) * MIN_BAND);
    chart.draw_series(std::iter::once(Rectangle::new(
        [(from, 0.0), (to, headroom(sc.mb_max))],
        color.filled(),
    )))?;
    Ok(())
}

/// Grey lines where passes start, numbered where there is room.
fn pass_marks(
    chart: &mut TimeChart<'_, '_>,
    timeline: &[Sample],
    sc: &Scales,
) -> anyhow::Result<()> {
    let top = headroom(sc.mb_max);
    let t_max = headroom(sc.t_max_s);
    let (plot_px, _) = chart.plotting_area().dim_in_pixel();
    let px_per_s = f64::from(plot_px) / t_max;
    let mut next_free = f64::NEG_INFINITY;
    for w in timeline.windows(2) {
        let (before, at) = (&w[0], &w[1]);
        let x = at.t_ms / 1000.0;
        if at.pass == before.pass || at.phase != Phase::Precopy {
            continue;
        }
        chart.draw_series(std::iter::once(PathElement::new(
            [(x, 0.0), (x, top)],
            GREY.mix(0.45),
        )))?;
        let name = at.pass.to_string();
        let width_s = f64::from(text_width(&name, LABEL_FONT) + 6) / px_per_s;
        // A number that would overlap the last, or run past the plot, is left out.
        if x >= next_free && x + width_s <= t_max {
            chart.draw_series(std::iter::once(Text::new(
                name,
                (x, top * 0.99),
                label().color(&GREY).pos(Pos::new(HPos::Left, VPos::Top)),
            )))?;
            next_free = x + width_s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures;

    #[test]
    fn a_precopy_pause_starts_at_the_switchover_and_lasts_the_downtime() {
        let s = spans(&fixtures::precopy());
        let (from, to) = s.paused.unwrap();
        assert!(
            (from - 2.9).abs() < 1e-9 && (to - 3.02).abs() < 1e-9,
            "{s:?}"
        );
        assert_eq!((s.postcopy, s.ended), (None, None));
    }

    #[test]
    fn a_postcopy_pause_ends_where_the_guest_resumed_on_the_destination() {
        let s = spans(&fixtures::postcopy());
        let (from, to) = s.paused.unwrap();
        assert!(
            (to - 2.3).abs() < 1e-9 && (from - 2.18).abs() < 1e-9,
            "{s:?}"
        );
        assert_eq!(s.postcopy, Some((2.3, 4.0)));
        assert!(s.broken.is_empty());
    }

    #[test]
    fn a_recovered_postcopy_shows_where_it_waited_for_a_recovery() {
        let s = spans(&fixtures::recovered());
        assert_eq!(s.broken, [(2.8, 3.3)]);
    }

    #[test]
    fn a_cancelled_run_has_no_pause_and_says_when_it_ended() {
        let s = spans(&fixtures::cancelled());
        assert_eq!(s.paused, None);
        assert_eq!(s.ended, Some((Phase::Cancelled, 1.5)));
    }
}
