//! An SVG bar chart of memory per device by option, stacked by kind, with the device-memory line.
//! Hand-written SVG: one `<rect>` per kind per bar, no dependency.

use super::size::{format_capacity, format_gb};
use super::Plan;
use std::fmt::Write;

const KINDS: &[(&str, &str)] = &[
    ("16-bit params", "#4e79a7"),
    ("grads", "#f28e2b"),
    ("fp32 master", "#e15759"),
    ("Adam m", "#76b7b2"),
    ("Adam v", "#59a14f"),
    ("reduce buckets, scratch", "#edc948"),
    ("gather pool", "#b07aa1"),
    ("persistent params", "#ff9da7"),
    ("activations", "#9c755f"),
];

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 140.0;

/// Renders the chart. Bars taller than three times the device memory are cut at the top of the
/// axis and labelled with their real total, so that the options near the line stay readable.
pub fn memory_chart_svg(plan: &Plan, device_memory: u64) -> String {
    let totals: Vec<u64> = plan
        .options
        .iter()
        .map(|o| o.bytes_per_device.total)
        .collect();
    let max_total = totals.iter().copied().max().unwrap_or(0).max(1);
    let y_max = (max_total
        .min(device_memory.saturating_mul(3))
        .max(device_memory) as f64
        * 1.1)
        .max(1.0);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let y = |bytes: f64| TOP + plot_h - (bytes.min(y_max) / y_max) * plot_h;
    let n = plan.options.len().max(1) as f64;
    let slot = plot_w / n;
    let bar_w = slot * 0.62;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" font-size="17" font-weight="bold" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(&format!(
            "Memory per device by ZeRO option: {:.3e} params, {} devices, {}",
            plan.params as f64,
            plan.world_size,
            plan.precision.name()
        ))
    );
    // Axis ticks in GB.
    let step = nice_step(y_max / 1e9 / 6.0);
    let mut tick = 0.0;
    while tick * 1e9 <= y_max {
        let ty = y(tick * 1e9);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            ty + 4.0,
            format_tick(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="20" y="{:.1}" transform="rotate(-90 20 {:.1})" text-anchor="middle">GB per device (1e9 bytes)</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (i, o) in plan.options.iter().enumerate() {
        let b = &o.bytes_per_device;
        let parts = [
            b.params,
            b.grads,
            b.master,
            b.adam_m,
            b.adam_v,
            b.reduce_buckets + b.scratch_buffers,
            b.gather_pool,
            b.persistent_params,
            b.activations,
        ];
        let x = LEFT + slot * i as f64 + (slot - bar_w) / 2.0;
        let mut base = 0.0;
        for (bytes, (kind, color)) in parts.iter().zip(KINDS) {
            if *bytes == 0 || base >= y_max {
                base += *bytes as f64;
                continue;
            }
            let top = base + *bytes as f64;
            let (y0, y1) = (y(base), y(top));
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y1:.1}" width="{bar_w:.1}" height="{:.1}" fill="{color}"><title>{}: {}</title></rect>"#,
                (y0 - y1).max(0.0),
                escape(kind),
                format_gb(*bytes)
            );
            base = top;
        }
        let total = b.total as f64;
        let label_y = y(total) - 6.0;
        let clipped = total > y_max;
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="{}">{}{}</text>"##,
            x + bar_w / 2.0,
            label_y,
            if o.fits { "#1a7f37" } else { "#b42318" },
            if clipped { "&#8593; " } else { "" },
            escape(&format_gb(b.total))
        );
        // Option label, rotated under the axis; fits mark above it.
        let lx = x + bar_w / 2.0;
        let ly = TOP + plot_h + 14.0;
        let _ = writeln!(
            s,
            r#"<text x="{lx:.1}" y="{ly:.1}" transform="rotate(-35 {lx:.1} {ly:.1})" text-anchor="end">{}</text>"#,
            escape(&o.label)
        );
    }
    // Device memory line.
    let my = y(device_memory as f64);
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{my:.1}" x2="{:.1}" y2="{my:.1}" stroke="#b42318" stroke-width="2" stroke-dasharray="8 5"/><text x="{:.1}" y="{:.1}" fill="#b42318" text-anchor="end">device memory {}</text>"##,
        LEFT + plot_w,
        LEFT + plot_w - 4.0,
        my - 6.0,
        escape(&format_capacity(device_memory))
    );
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        TOP + plot_h,
        TOP + plot_h,
        LEFT + plot_w,
        TOP + plot_h
    );
    // Legend.
    let lx = WIDTH - RIGHT + 20.0;
    for (i, (kind, color)) in KINDS.iter().enumerate() {
        let ly = TOP + 10.0 + 22.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{ly:.1}" width="14" height="14" fill="{color}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 20.0,
            ly + 11.0,
            escape(kind)
        );
    }
    let ly = TOP + 10.0 + 22.0 * KINDS.len() as f64 + 10.0;
    let _ = writeln!(
        s,
        r##"<text x="{lx}" y="{ly:.1}" fill="#1a7f37">green total: fits</text><text x="{lx}" y="{:.1}" fill="#b42318">red total: does not fit</text><text x="{lx}" y="{:.1}">&#8593; bar cut at the top</text>"##,
        ly + 18.0,
        ly + 36.0
    );
    s.push_str("</svg>\n");
    s
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|v| *v >= raw)
        .unwrap_or(10.0 * p)
}

fn format_tick(gb: f64) -> String {
    if gb >= 1.0 || gb == 0.0 {
        format!("{gb:.0}")
    } else {
        format!("{gb:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
