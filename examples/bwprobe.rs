use rayon::prelude::*;
use std::time::Instant;
use zerodp::comm::zeroed_vec;

fn k28_sse(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: f32) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *p += s * g;
        *m += s * g;
        *v += s * g;
    }
}
#[target_feature(enable = "avx512f")]
unsafe fn k28(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: f32) {
    k28_sse(p, g, m, v, s)
}
fn k12_sse(a: &mut [f32], b: &[f32], s: f32) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += s * b;
    }
}
#[target_feature(enable = "avx512f")]
unsafe fn k12(a: &mut [f32], b: &[f32], s: f32) {
    k12_sse(a, b, s)
}
fn main() {
    println!("bench-style {:.1}", stream_gbps(2, 6));
    let n = 100_000_000usize;
    let mut p: Vec<f32> = zeroed_vec(n);
    let g: Vec<f32> = zeroed_vec(n);
    let mut m: Vec<f32> = zeroed_vec(n);
    let mut v: Vec<f32> = zeroed_vec(n);
    const C: usize = 1 << 15;
    let med = |f: &mut dyn FnMut()| {
        let mut t: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[2]
    };
    for _ in 0..2 {
        let a = med(&mut || {
            p.par_chunks_mut(C)
                .zip(g.par_chunks(C))
                .zip(m.par_chunks_mut(C))
                .zip(v.par_chunks_mut(C))
                .for_each(|(((p, g), m), v)| unsafe { k28(p, g, m, v, 0.5) })
        });
        let b = med(&mut || {
            p.par_chunks_mut(C)
                .zip(g.par_chunks(C))
                .zip(m.par_chunks_mut(C))
                .zip(v.par_chunks_mut(C))
                .for_each(|(((p, g), m), v)| k28_sse(p, g, m, v, 0.5))
        });
        let c = med(&mut || {
            p.par_chunks_mut(C)
                .zip(g.par_chunks(C))
                .for_each(|(p, g)| unsafe { k12(p, g, 0.5) })
        });
        let d = med(&mut || {
            p.par_chunks_mut(C)
                .zip(g.par_chunks(C))
                .for_each(|(p, g)| k12_sse(p, g, 0.5))
        });
        let h = n / 2;
        let e = med(&mut || {
            std::thread::scope(|s| {
                let (p0, p1) = p.split_at_mut(h);
                let (g0, g1) = g.split_at(h);
                s.spawn(|| k12_sse(p0, g0, 0.5));
                s.spawn(|| k12_sse(p1, g1, 0.5));
            })
        });
        println!("28B avx512 {:.1}  28B sse {:.1}  12B avx512 {:.1}  12B sse {:.1}  12B sse 2 halves {:.1} GB/s",
            28.0 * n as f64 / a / 1e9, 28.0 * n as f64 / b / 1e9, 12.0 * n as f64 / c / 1e9, 12.0 * n as f64 / d / 1e9, 12.0 * n as f64 / e / 1e9);
    }
}
pub fn filled<T: bytemuck::Zeroable + Copy>(len: usize, x: T) -> Vec<T> {
    let mut v = zeroed_vec(len);
    v.fill(x);
    v
}
pub fn stream_gbps(threads: usize, runs: usize) -> f64 {
    let len = (256 << 20) / 4;
    let mut a = filled(len, 0.0f32);
    let b = filled(len, 1.0f32);
    let chunk = len.div_ceil(threads);
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for (a, b) in a.chunks_mut(chunk).zip(b.chunks(chunk)) {
                    s.spawn(move || {
                        for (a, b) in a.iter_mut().zip(b) {
                            *a += 3.0 * b;
                        }
                    });
                }
            });
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    println!("{:?}", t);
    (3 * (256 << 20)) as f64 / t[runs / 2] / 1e9
}
