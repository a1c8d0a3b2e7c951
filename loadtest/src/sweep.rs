//! Steps the offered (open-loop) rate up until the service saturates, and draws latency against
//! achieved throughput as an SVG.

use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use crate::report::Report;

#[derive(Debug, Serialize)]
pub struct Sweep {
    pub points: Vec<Report>,
    /// Why the sweep stopped.
    pub stopped: String,
}

/// Saturated: the service answers OK less than 90% of the offered rate, or errors pass 1%.
pub fn saturated(r: &Report) -> Option<String> {
    let offered = r.offered_rate.unwrap_or(r.sent_per_s);
    if r.requests_per_s < 0.9 * offered {
        return Some(format!(
            "at {offered:.0} req/s offered only {:.0} req/s were answered OK",
            r.requests_per_s
        ));
    }
    let errors = r.sent.saturating_sub(r.ok);
    if errors * 100 > r.sent {
        return Some(format!(
            "at {offered:.0} req/s offered {errors} of {} requests failed",
            r.sent
        ));
    }
    None
}

pub fn draw(sweep: &Sweep, title: &str, path: &Path) -> anyhow::Result<()> {
    let pts = &sweep.points;
    let x_max = pts.iter().map(|p| p.requests_per_s).fold(1.0, f64::max) * 1.1;
    let y_max = pts.iter().map(|p| p.latency_ms.p99).fold(0.01, f64::max) * 1.5;
    let y_min = pts
        .iter()
        .map(|p| p.latency_ms.p50)
        .fold(f64::INFINITY, f64::min)
        .max(1e-3)
        / 1.5;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, (y_min..y_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("achieved throughput (OK requests/s)")
        .y_desc("latency (ms)")
        .draw()?;
    for (name, color, pick) in [
        (
            "p50",
            BLUE,
            (|r: &Report| r.latency_ms.p50) as fn(&Report) -> f64,
        ),
        ("p90", GREEN, |r: &Report| r.latency_ms.p90),
        ("p99", RED, |r: &Report| r.latency_ms.p99),
    ] {
        let series: Vec<(f64, f64)> = pts
            .iter()
            .map(|r| (r.requests_per_s, pick(r).max(y_min)))
            .collect();
        chart
            .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart.draw_series(
            series
                .into_iter()
                .map(|p| Circle::new(p, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}
