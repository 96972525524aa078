//! A small deterministic PRNG (splitmix64) with normal samples (Box-Muller) and unbiased-enough
//! bounded integers, so that parameter initialisation and data order are a function of the seed
//! alone: identical on every rank, every world size and every platform, with no `rand` dependency.

/// Mix several words into one seed, so that independent streams (one per parameter tensor, one
/// per epoch) never share a state sequence.
pub fn mix_seed(words: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &w in words {
        h = splitmix64_step(&mut (h ^ w.wrapping_mul(0xD6E8_FEB8_6659_FD93)));
    }
    h
}

/// splitmix64's state increment (the golden ratio in 64 bits): the state after `d` draws is the
/// seed plus `d` times this, so any point of a stream can be reached without drawing.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix64_step(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 (Steele, Lea, Flood 2014): 64-bit state, passes BigCrush, trivially reproducible.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
    /// The second value of the last Box-Muller pair, returned by the next [`Self::normal`].
    spare_normal: Option<f64>,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed,
            spare_normal: None,
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        splitmix64_step(&mut self.state)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n) by Lemire's multiply-shift (bias below 2^-32 for n < 2^32).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal sample (Box-Muller; both values of each pair are used).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        self.spare_normal = Some(r * theta.sin());
        r * theta.cos()
    }

    /// The stream of `seed` after `draws` calls of [`Self::next_u64`] (no spare normal pending).
    fn after_draws(seed: u64, draws: u64) -> Self {
        Self::new(seed.wrapping_add(draws.wrapping_mul(GAMMA)))
    }

    /// Shuffle `items` in place (Fisher-Yates, from the end).
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// Elements per parallel task of [`fill_normal`]: even, so that every task starts at a whole
/// Box-Muller pair.
const NORMAL_TASK: usize = 1 << 16;

/// `dst[i] = (normal_i * std) as f32` where `normal_i` is the `i`-th [`SplitMix64::normal`] of
/// the stream `seed`: the bits of drawing them one after another, drawn on the rayon pool.
///
/// WHY: initialising a 10-billion-parameter model one normal at a time took minutes (about 21 s per
/// billion here); each normal pair consumes exactly two draws, so the task that starts at element
/// `o` (even) starts the stream at draw `o` and writes what the sequential loop would have.
pub(crate) fn fill_normal(dst: &mut [f32], seed: u64, std: f64) {
    use rayon::prelude::*;
    dst.par_chunks_mut(NORMAL_TASK)
        .enumerate()
        .for_each(|(task, chunk)| {
            let mut rng = SplitMix64::after_draws(seed, (task * NORMAL_TASK) as u64);
            chunk
                .iter_mut()
                .for_each(|x| *x = (rng.normal() * std) as f32);
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let a: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix64::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix64::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(SplitMix64::new(8), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(mix_seed(&[1, 2]), mix_seed(&[2, 1]));
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut r = SplitMix64::new(42);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
    }

    #[test]
    fn fill_normal_gives_the_sequential_streams_bits() {
        // Lengths around the task size (odd ones end on the first value of a pair), on 1 and 3
        // threads.
        for len in [
            0,
            1,
            7,
            NORMAL_TASK - 1,
            NORMAL_TASK,
            NORMAL_TASK + 1,
            3 * NORMAL_TASK + 5,
        ] {
            let mut rng = SplitMix64::new(99);
            let expected: Vec<u32> = (0..len)
                .map(|_| ((rng.normal() * 0.02) as f32).to_bits())
                .collect();
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut got = vec![f32::NAN; len];
                pool.install(|| fill_normal(&mut got, 99, 0.02));
                let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                assert!(got == expected, "len {len}, {threads} threads");
            }
        }
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<usize> = (0..1000).collect();
        SplitMix64::new(3).shuffle(&mut v);
        assert_ne!(v, (0..1000).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
    }
}
