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
    let frame = Frame::new(plan, device_memory);
    let mut s = String::new();
    header(&mut s, plan);
    axis(&mut s, &frame);
    for (i, o) in plan.options.iter().enumerate() {
        bar(&mut s, &frame, i, o);
    }
    device_line(&mut s, &frame, device_memory);
    legend(&mut s);
    s.push_str("</svg>\n");
    s
}

/// The plot's scale: the bytes at the top of the axis and the width of each option's slot.
struct Frame {
    y_max: f64,
    plot_w: f64,
    plot_h: f64,
    slot: f64,
    bar_w: f64,
}

impl Frame {
    /// The axis reaches the tallest total, but no further than three times the device memory
    /// (and at least to it), with 10% headroom.
    fn new(plan: &Plan, device_memory: u64) -> Self {
        let totals = plan.options.iter().map(|o| o.bytes_per_device.total);
        let max_total = totals.max().unwrap_or(0).max(1);
        let y_max = (max_total
            .min(device_memory.saturating_mul(3))
            .max(device_memory) as f64
            * 1.1)
            .max(1.0);
        let plot_w = WIDTH - LEFT - RIGHT;
        let slot = plot_w / plan.options.len().max(1) as f64;
        Frame {
            y_max,
            plot_w,
            plot_h: HEIGHT - TOP - BOTTOM,
            slot,
            bar_w: slot * 0.62,
        }
    }

    /// The height of `bytes` on the axis (cut at its top).
    fn y(&self, bytes: f64) -> f64 {
        TOP + self.plot_h - (bytes.min(self.y_max) / self.y_max) * self.plot_h
    }
}

/// The SVG element, its background and the title.
fn header(s: &mut String, plan: &Plan) {
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
}

/// The y axis's ticks in GB, with grid lines, and its title.
fn axis(s: &mut String, f: &Frame) {
    let step = nice_step(f.y_max / 1e9 / 6.0);
    let mut tick = 0.0;
    while tick * 1e9 <= f.y_max {
        let ty = f.y(tick * 1e9);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{:.1}" y2="{ty:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + f.plot_w,
            LEFT - 6.0,
            ty + 4.0,
            format_tick(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="20" y="{:.1}" transform="rotate(-90 20 {:.1})" text-anchor="middle">GB per device (1e9 bytes)</text>"#,
        TOP + f.plot_h / 2.0,
        TOP + f.plot_h / 2.0
    );
}

/// Option `i`'s bar, stacked by kind, its total (green if it fits) and its rotated label.
fn bar(s: &mut String, f: &Frame, i: usize, o: &super::PlanOption) {
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
    let x = LEFT + f.slot * i as f64 + (f.slot - f.bar_w) / 2.0;
    let mut base = 0.0;
    for (bytes, (kind, color)) in parts.iter().zip(KINDS) {
        if *bytes == 0 || base >= f.y_max {
            base += *bytes as f64;
            continue;
        }
        let top = base + *bytes as f64;
        let (y0, y1) = (f.y(base), f.y(top));
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{y1:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}: {}</title></rect>"#,
            f.bar_w,
            (y0 - y1).max(0.0),
            escape(kind),
            format_gb(*bytes)
        );
        base = top;
    }
    let total = b.total as f64;
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="{}">{}{}</text>"##,
        x + f.bar_w / 2.0,
        f.y(total) - 6.0,
        if o.fits { "#1a7f37" } else { "#b42318" },
        if total > f.y_max { "&#8593; " } else { "" },
        escape(&format_gb(b.total))
    );
    // Option label, rotated under the axis.
    let lx = x + f.bar_w / 2.0;
    let ly = TOP + f.plot_h + 14.0;
    let _ = writeln!(
        s,
        r#"<text x="{lx:.1}" y="{ly:.1}" transform="rotate(-35 {lx:.1} {ly:.1})" text-anchor="end">{}</text>"#,
        escape(&o.label)
    );
}

/// The dashed device-memory line, and the axes' two lines.
fn device_line(s: &mut String, f: &Frame, device_memory: u64) {
    let my = f.y(device_memory as f64);
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{my:.1}" x2="{:.1}" y2="{my:.1}" stroke="#b42318" stroke-width="2" stroke-dasharray="8 5"/><text x="{:.1}" y="{:.1}" fill="#b42318" text-anchor="end">device memory {}</text>"##,
        LEFT + f.plot_w,
        LEFT + f.plot_w - 4.0,
        my - 6.0,
        escape(&format_capacity(device_memory))
    );
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" stroke="black"/><line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        TOP + f.plot_h,
        TOP + f.plot_h,
        LEFT + f.plot_w,
        TOP + f.plot_h
    );
}

/// The kinds' colours and what the totals' colours and arrow mean.
fn legend(s: &mut String) {
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
