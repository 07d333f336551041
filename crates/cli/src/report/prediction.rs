//! The prediction chart: the total time each pass end predicted for the way it chose (a
//! marked line), against the total the migration took (a flat line), on the scales all runs
//! share. Drawn only when some run has a prediction.

use ferry_migrate::MigrationStats;
use plotters::prelude::*;

use super::canvas::{
    Area, BLUE, ORANGE, Scales, Swatch, UNIT_ROOM, axis_units, header, headroom, label,
};

/// Each predicted pass: the pass and the total its chosen way predicts, ms.
pub(super) fn predicted_totals(s: &MigrationStats) -> Vec<(u32, f64)> {
    s.passes
        .iter()
        .filter_map(|p| Some((p.pass, p.predicted?.forecast().total_ms?)))
        .collect()
}

/// The predicted total per pass against the actual total.
pub(super) fn chart(area: &Area<'_>, s: &MigrationStats, sc: &Scales) -> anyhow::Result<()> {
    let area = header(
        area,
        &format!("Predicted total (actual {:.0} ms)", s.total_ms),
        &[
            ("predicted at the pass end", BLUE, Swatch::Line),
            ("actual", ORANGE, Swatch::Line),
        ],
    )?;
    let n = sc.passes_max.max(1) as f64;
    let mut chart = ChartBuilder::on(&area)
        .margin(10)
        .margin_top(UNIT_ROOM)
        .margin_right(24)
        .x_label_area_size(36)
        .y_label_area_size(58)
        .build_cartesian_2d(0.5f64..n + 0.5, 0f64..headroom(sc.predicted_ms_max))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(sc.passes_max.clamp(1, 24))
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() > 1e-6 || i < 1.0 {
                String::new()
            } else {
                format!("{i:.0}")
            }
        })
        .x_desc("pass")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(label())
        .axis_desc_style(label())
        .light_line_style(WHITE)
        .draw()?;
    axis_units(&area, chart.plotting_area(), "ms", None)?;
    chart.draw_series(LineSeries::new(
        [(0.5, s.total_ms), (n + 0.5, s.total_ms)],
        ORANGE.stroke_width(2),
    ))?;
    let points = predicted_totals(s)
        .into_iter()
        .map(|(pass, ms)| (f64::from(pass), ms));
    chart.draw_series(LineSeries::new(points, BLUE.stroke_width(2)).point_size(4))?;
    Ok(())
}
