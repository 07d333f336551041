//! The latencies of a run's postcopy page requests as a histogram (precopy has none; the chart
//! appears when any run of a report counted some). The destination counts each request in a
//! power-of-two bucket (`PostcopyStats::latency_buckets`: bucket k holds the requests that took
//! [2^k, 2^(k+1)) µs from fault to page in place), so the histogram has one bar per non-empty
//! bucket on a log scale, over the buckets any run of the report filled.

use ferry_migrate::MigrationStats;
use plotters::prelude::*;

use super::canvas::{Area, BLUE, Scales, Swatch, UNIT_ROOM, axis_units, header, headroom, label};

/// Space per x-axis label ("131 ms" at 13 px and a gap): fewer labels than buckets when the
/// buckets are narrower.
const LABEL_SPACING_PX: u32 = 56;

/// The postcopy request latencies as one bar per non-empty bucket, on the buckets and counts
/// every run of the report shares.
pub(super) fn histogram(area: &Area<'_>, s: &MigrationStats, sc: &Scales) -> anyhow::Result<()> {
    let Some((lo, hi)) = sc.latency_buckets else {
        return Ok(());
    };
    let pc = s.postcopy.as_ref();
    let title = match pc {
        Some(pc) if pc.requests > 0 => format!(
            "Postcopy fault to page: p50 {}, p99 {}, max {}",
            duration(pc.latency_p50_us as f64),
            duration(pc.latency_p99_us as f64),
            duration(pc.latency_max_us as f64)
        ),
        _ => "Postcopy fault to page".into(),
    };
    let area = header(area, &title, &[("requests", BLUE, Swatch::Block)])?;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(UNIT_ROOM)
        // Room for half of the last edge's label ("8.2 ms") past the plot.
        .margin_right(32)
        .x_label_area_size(36)
        .y_label_area_size(58)
        // Bucket k spans k..k + 1 on the axis; a tick at k is its lower bound, 2^k µs.
        .build_cartesian_2d(
            lo as f64..(hi + 1) as f64,
            0f64..headroom(sc.latency_count_max as f64),
        )?;
    let edge = |v: &f64| match v.fract() == 0.0 {
        true => duration(2f64.powf(*v)),
        false => String::new(),
    };
    let plot_px = chart.plotting_area().dim_in_pixel().0;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels((plot_px / LABEL_SPACING_PX).clamp(2, (hi - lo + 2) as u32) as usize)
        .x_label_formatter(&edge)
        .x_desc("fault to page, log scale (each bar: from its left edge to twice that)")
        // Counts are whole: a tick between two (a short axis has them every half) is left
        // unlabelled, not rounded to repeat its neighbour's label.
        .y_label_formatter(&|v| match v.fract() == 0.0 {
            true => format!("{v:.0}"),
            false => String::new(),
        })
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    axis_units(&area, chart.plotting_area(), "requests", None)?;
    let buckets = pc.map_or(&[][..], |pc| &pc.latency_buckets);
    if !buckets.iter().any(|&c| c > 0) {
        let (width, height) = area.dim_in_pixel();
        let note = match pc {
            Some(_) => "no postcopy page requests",
            None => "no postcopy in this run",
        };
        area.draw_text(note, &label(), (width as i32 / 3, height as i32 / 3))?;
        return Ok(());
    }
    // A bucket of a few requests in a tail of thousands still shows: 1% of the axis at least.
    let least = headroom(sc.latency_count_max as f64) * 0.01;
    chart.draw_series(
        buckets
            .iter()
            .enumerate()
            .filter(|&(_, &count)| count > 0)
            .map(|(k, &count)| {
                let k = k as f64;
                let mut bar = Rectangle::new(
                    [(k, 0.0), (k + 1.0, (count as f64).max(least))],
                    BLUE.filled(),
                );
                bar.set_margin(0, 0, 1, 1);
                bar
            }),
    )?;
    Ok(())
}

/// A latency in µs as a reader takes it in: µs under a millisecond, then ms, then s.
pub(super) fn duration(us: f64) -> String {
    match us {
        us if us < 1e3 => format!("{us:.0} µs"),
        us if us < 1e4 => format!("{:.1} ms", us / 1e3),
        us if us < 1e6 => format!("{:.0} ms", us / 1e3),
        us => format!("{:.1} s", us / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_read_in_the_unit_that_suits_them() {
        let cases = [
            (1.0, "1 µs"),
            (512.0, "512 µs"),
            (1024.0, "1.0 ms"),
            (4096.0, "4.1 ms"),
            (131_072.0, "131 ms"),
            (2_097_152.0, "2.1 s"),
        ];
        for (us, text) in cases {
            assert_eq!(duration(us), text, "{us} µs");
        }
    }
}
