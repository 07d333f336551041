//! The postcopy page latencies of a run as a histogram (precopy has none; the chart appears
//! when any run of a report has some).

use plotters::prelude::*;

use super::charts::{BLUE, Swatch, header, label};
use super::plot::{Area, Scales};

/// Histogram buckets: fine enough to show a tail's shape, coarse enough for ten-pixel bars.
const LATENCY_BUCKETS: u32 = 40;

/// The postcopy page latencies as a histogram of [`LATENCY_BUCKETS`] equal buckets up to the
/// largest latency of any run.
pub(super) fn histogram(
    area: &Area<'_>,
    s: &ferry_migrate::MigrationStats,
    sc: &Scales,
) -> anyhow::Result<()> {
    let counts = buckets(&s.page_latencies_us, sc.latency_max_us);
    let top = counts.iter().copied().max().unwrap_or(0).max(1);
    let width_us = bucket_width(sc.latency_max_us);
    let area = header(
        area,
        "Postcopy page latency",
        &[("pages", BLUE, Swatch::Block)],
    )?;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(4)
        .margin_right(16)
        .x_label_area_size(36)
        .y_label_area_size(58)
        .build_cartesian_2d(
            (0u32..LATENCY_BUCKETS).into_segmented(),
            0u32..(top + top / 10 + 1),
        )?;
    let us = |v: &SegmentValue<u32>| match v {
        SegmentValue::Exact(b) | SegmentValue::CenterOf(b) => {
            format!("{:.0}", f64::from(*b) * width_us)
        }
        SegmentValue::Last => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(10)
        .x_label_formatter(&us)
        .x_desc("µs from fault to page")
        .y_desc("pages")
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    if s.page_latencies_us.is_empty() {
        let (width, height) = area.dim_in_pixel();
        area.draw_text(
            "no postcopy page latencies",
            &label(),
            (width as i32 / 3, height as i32 / 3),
        )?;
        return Ok(());
    }
    chart.draw_series(
        Histogram::vertical(&chart)
            .style(BLUE.filled())
            .margin(1)
            .data(counts.iter().enumerate().map(|(i, &c)| (i as u32, c))),
    )?;
    Ok(())
}

fn bucket_width(max_us: f64) -> f64 {
    (max_us / f64::from(LATENCY_BUCKETS)).max(1e-9)
}

/// How many latencies fall in each of [`LATENCY_BUCKETS`] equal buckets up to `max_us`.
pub(super) fn buckets(latencies_us: &[f64], max_us: f64) -> Vec<u32> {
    let mut counts = vec![0u32; LATENCY_BUCKETS as usize];
    let width = bucket_width(max_us);
    for &l in latencies_us {
        let i = ((l / width) as usize).min(LATENCY_BUCKETS as usize - 1);
        counts[i] += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::plot::{Run, render};

    #[test]
    fn latencies_fill_equal_buckets_and_the_largest_lands_in_the_last() {
        let counts = buckets(&[0.0, 10.0, 24.9, 25.0, 1000.0], 1000.0);
        assert_eq!(counts.len(), LATENCY_BUCKETS as usize);
        assert_eq!(counts[0], 3, "0, 10 and 24.9 µs are under 25 µs");
        assert_eq!(counts[1], 1);
        assert_eq!(counts[LATENCY_BUCKETS as usize - 1], 1);
        assert_eq!(counts.iter().sum::<u32>(), 5);
    }

    #[test]
    fn a_run_with_postcopy_latencies_gets_a_histogram() {
        let stats = ferry_migrate::MigrationStats {
            page_latencies_us: (0..500)
                .map(|i| 80.0 + f64::from(i % 40) + f64::from(i / 100) * 400.0)
                .collect(),
            ..Default::default()
        };
        let with = render(&[Run {
            name: "postcopy".into(),
            stats,
        }])
        .unwrap();
        assert!(with.contains("Postcopy page latency"), "{with}");
        let without = render(&[Run {
            name: "precopy".into(),
            stats: Default::default(),
        }])
        .unwrap();
        assert!(!without.contains("Postcopy page latency"));
    }
}
