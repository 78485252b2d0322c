//! Token sampling: greedy at temperature 0, otherwise temperature with top-k, top-p and min-p
//! filters, from a seeded generator so runs are reproducible.
//!
//! # The definition
//! One algorithm, written so that a GPU computes it naturally and the host reproduces it bit for
//! bit (the CUDA backend samples on the device with `kernels/sample.cu`; the other backends read
//! the logits back and call [`pick`]). Given the logits `l` and a [`DeviceSample`] `s`:
//!
//! 1. **Greedy** when `s.temperature` is not above 0: [`argmax`], the largest logit by `>` (NaN never
//!    wins), the lowest id on ties, 0 when no logit is above -inf. The generator is not advanced.
//! 2. Otherwise the **candidates** are the finite logits; none finite: greedy as in 1. Keep the
//!    first `K = min(top_k, finite count)` in the order (logit descending by `f32::total_cmp`,
//!    id ascending), where a `top_k` of 0 (no limit) or above [`CANDIDATE_CAP`] means the cap:
//!    like most engines, at most 1024 candidates are weighed (after the default min-p 0.05 far
//!    fewer survive anyway).
//! 3. **Weights** `p_i = numerics::exp((l_i - l_0) / T)` for the sorted candidates, with the
//!    canonical exp (not `std`) and IEEE f32 subtraction and division, each rounded on its own.
//!    `sum` adds them in candidate order, sequentially from +0.
//! 4. **Cut**: `min_prob = p_0 / sum * min_p`; walking `i = 0, 1, ...`, stop before candidate
//!    `i > 0` when `p_i / sum < min_prob`; otherwise keep it, add it to `kept_sum` (sequentially
//!    from +0) and stop after it when `kept_sum / sum >= top_p`. The kept count is
//!    `min(a, b + 1)` with `a` the first `i > 0` failing min-p and `b` the first `i` whose prefix
//!    sum reaches top-p (each `K` if none): the GPU finds `a` and `b` in parallel.
//! 5. **Draw**: `u` is uniform in [0, 1), `(x >> 40) / 2^24` of the next xorshift64* output, drawn
//!    on the host once per sampled token when the temperature is above 0 (also when no logit
//!    turns out finite, so the host and the device consume the generator alike) and handed to
//!    the device with the call. `r = u * kept_sum`; for the kept candidates in order,
//!    `r -= p_i` and the first one with `r <= 0` is the token; none (rounding): the last kept.
//!
//! Settings outside their ranges are clamped when the draw is made ([`Sampler::draw`]): NaN or
//! negative temperature is greedy, top-p and min-p are clamped to [0, 1] (NaN: no limit).

/// The most candidates weighed when the temperature is above 0: `top_k` 0 (no limit) or above
/// this means this. The CUDA kernel sorts them in one block of this many threads.
pub const CANDIDATE_CAP: usize = 1024;

/// One token's sampling, resolved: the settings clamped to their ranges and the uniform draw.
/// What a backend that samples on the device needs ([`crate::backend::Executable::sample`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSample {
    /// 0 (or anything not above 0): greedy, and the other fields are unused.
    pub temperature: f32,
    /// Candidates kept before the filters; 0 or above [`CANDIDATE_CAP`] means the cap
    /// ([`DeviceSample::candidates`]).
    pub top_k: u32,
    /// In [0, 1]; 1 keeps every candidate.
    pub top_p: f32,
    /// In [0, 1]; 0 keeps every candidate.
    pub min_p: f32,
    /// Uniform in [0, 1), drawn on the host.
    pub r: f32,
}

impl DeviceSample {
    /// Greedy: the argmax.
    pub const GREEDY: DeviceSample = DeviceSample { temperature: 0.0, top_k: 1, top_p: 1.0, min_p: 0.0, r: 0.0 };

    /// Whether this is the argmax: a temperature that is not above 0 (NaN included).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// The number of candidates kept before the filters: `top_k`, with 0 or anything above
    /// [`CANDIDATE_CAP`] meaning the cap.
    pub fn candidates(&self) -> u32 {
        if self.top_k == 0 || self.top_k as usize > CANDIDATE_CAP {
            CANDIDATE_CAP as u32
        } else {
            self.top_k
        }
    }
}

/// Sampling knobs. `top_k == 0` keeps every token up to [`CANDIDATE_CAP`]; `top_p == 1` and
/// `min_p == 0` disable those filters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

/// Why a sampling setting is refused. The message names the setting and its allowed range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("temperature {0} must be a finite number at least 0 (0 is greedy)")]
    Temperature(f32),
    #[error("top-p {0} must be between 0 and 1 (1 keeps every token)")]
    TopP(f32),
    #[error("min-p {0} must be between 0 and 1 (0 keeps every token)")]
    MinP(f32),
}

/// Checks a temperature: finite and at least 0. NaN and infinities are refused, never mapped
/// to greedy or uniform sampling behind the caller's back.
pub fn check_temperature(t: f32) -> Result<f32, SamplerError> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(SamplerError::Temperature(t))
    }
}

/// Checks a top-p: a probability mass in [0, 1]; 0 keeps only the most likely token.
pub fn check_top_p(p: f32) -> Result<f32, SamplerError> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(SamplerError::TopP(p))
    }
}

/// Checks a min-p: a fraction of the top probability in [0, 1].
pub fn check_min_p(p: f32) -> Result<f32, SamplerError> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(SamplerError::MinP(p))
    }
}

impl SamplerConfig {
    /// Checks every setting; callers should refuse a config that fails rather than sample with it.
    pub fn validate(&self) -> Result<(), SamplerError> {
        check_temperature(self.temperature)?;
        check_top_p(self.top_p)?;
        check_min_p(self.min_p)?;
        Ok(())
    }
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
    candidates: Vec<(f32, u32)>,
    probs: Vec<f32>,
}

/// The index of the largest logit by `>` (NaN never wins; the first one on ties); 0 if none is
/// above -inf.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// The token the definition (module docs) picks from `logits` for one resolved draw: what a
/// device sampler must return for the same `s`.
pub fn pick(logits: &[f32], s: &DeviceSample) -> u32 {
    pick_with(logits, s, &mut Vec::new(), &mut Vec::new())
}

/// [`pick`] with reusable buffers.
fn pick_with(logits: &[f32], s: &DeviceSample, cand: &mut Vec<(f32, u32)>, probs: &mut Vec<f32>) -> u32 {
    if s.is_greedy() {
        return argmax(logits);
    }
    cand.clear();
    cand.extend(logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (v, i as u32)));
    if cand.is_empty() {
        return argmax(logits);
    }
    // Descending by logit, lower id first on ties.
    let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let k = s.candidates() as usize;
    if k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_logit);
        cand.truncate(k);
    }
    cand.sort_unstable_by(by_logit);

    let max = cand[0].0;
    probs.clear();
    probs.extend(cand.iter().map(|&(v, _)| crate::numerics::exp((v - max) / s.temperature)));
    let mut sum = 0.0f32;
    for &p in probs.iter() {
        sum += p;
    }
    let min_prob = probs[0] / sum * s.min_p;
    let mut kept = 0;
    let mut kept_sum = 0.0f32;
    for (i, &p) in probs.iter().enumerate() {
        if i > 0 && p / sum < min_prob {
            break;
        }
        kept += 1;
        kept_sum += p;
        if kept_sum / sum >= s.top_p {
            break;
        }
    }
    let mut r = s.r * kept_sum;
    for (i, &p) in probs[..kept].iter().enumerate() {
        r -= p;
        if r <= 0.0 {
            return cand[i].1;
        }
    }
    cand[kept - 1].1
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        // A zero xorshift state would stay zero; mix the seed first.
        let state = cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
        Sampler { cfg, state: state.max(1), candidates: Vec::new(), probs: Vec::new() }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Uniform in [0, 1) from xorshift64*.
    fn next_f32(&mut self) -> f32 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Resolves the next token's sampling: the settings clamped to their ranges (see
    /// [`SamplerConfig::validate`]; callers are expected to refuse bad ones first, but sampling
    /// never panics) and, unless greedy, one uniform draw from the generator.
    pub fn draw(&mut self) -> DeviceSample {
        let c = self.cfg;
        if c.temperature.is_nan() || c.temperature <= 0.0 {
            return DeviceSample::GREEDY;
        }
        DeviceSample {
            temperature: c.temperature,
            top_k: c.top_k.min(CANDIDATE_CAP) as u32,
            top_p: if c.top_p.is_nan() { 1.0 } else { c.top_p.clamp(0.0, 1.0) },
            min_p: if c.min_p.is_nan() { 0.0 } else { c.min_p.clamp(0.0, 1.0) },
            r: self.next_f32(),
        }
    }

    /// Picks the next token from `logits` on the host: [`Sampler::draw`], then [`pick`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let s = self.draw();
        self.pick(logits, &s)
    }

    /// [`pick`] with this sampler's buffers, for a draw made with [`Sampler::draw`].
    pub fn pick(&mut self, logits: &[f32], s: &DeviceSample) -> u32 {
        pick_with(logits, s, &mut self.candidates, &mut self.probs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_at_zero_temperature() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, f32::NAN]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproduces() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.1).collect();
        let cfg = SamplerConfig { temperature: 1.0, top_k: 1, ..Default::default() };
        assert_eq!(Sampler::new(cfg).sample(&logits), argmax(&logits));
        let cfg = SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 7 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn filters_restrict_the_support() {
        // Two strong tokens and many weak ones: min-p 0.5 must keep only the strong ones.
        let mut logits = vec![0.0f32; 64];
        logits[5] = 10.0;
        logits[9] = 10.0;
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.5, seed: 3 };
        let mut s = Sampler::new(cfg);
        for _ in 0..200 {
            let t = s.sample(&logits);
            assert!(t == 5 || t == 9, "sampled {t}");
        }
        // top-p 0.4 keeps only the first of the two (ties broken by id).
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.4, min_p: 0.0, seed: 3 };
        let mut s = Sampler::new(cfg);
        assert!((0..100).all(|_| s.sample(&logits) == 5));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // p(1) = e/(1+e) ~ 0.731 at temperature 1.
        let logits = [0.0f32, 1.0];
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 11 };
        let mut s = Sampler::new(cfg);
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f32 / n as f32;
        assert!((ones - 0.731).abs() < 0.02, "{ones}");
    }

    #[test]
    fn top_k_zero_or_above_the_cap_means_the_cap() {
        // 3000 distinct logits, the largest first, at a temperature that makes them nearly
        // uniform: only the first 1024 ids can come out, and the last of them do.
        let logits: Vec<f32> = (0..3000).map(|i| -(i as f32) * 1e-3).collect();
        let draws = |top_k: usize| -> Vec<u32> {
            let cfg = SamplerConfig { temperature: 1e3, top_k, top_p: 1.0, min_p: 0.0, seed: 5 };
            let mut s = Sampler::new(cfg);
            (0..2000).map(|_| s.sample(&logits)).collect()
        };
        let capped = draws(0);
        assert!(capped.iter().all(|&t| (t as usize) < CANDIDATE_CAP));
        assert!(capped.iter().any(|&t| t as usize >= CANDIDATE_CAP - 50));
        assert_eq!(draws(CANDIDATE_CAP), capped);
        assert_eq!(draws(5000), capped);
        assert_eq!(draws(usize::MAX), capped);
        assert!(draws(10).iter().all(|&t| t < 10));
    }

    #[test]
    fn top_k_above_the_vocabulary_keeps_every_token() {
        let logits: Vec<f32> = (0..10).map(|i| (i % 3) as f32).collect();
        let draws = |top_k: usize| -> Vec<u32> {
            let cfg = SamplerConfig { temperature: 0.8, top_k, top_p: 1.0, min_p: 0.0, seed: 9 };
            let mut s = Sampler::new(cfg);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(draws(40), draws(0));
        assert_eq!(draws(10), draws(0));
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let logits = vec![1.5f32; 100];
        let cfg = SamplerConfig { temperature: 1.0, top_k: 3, top_p: 1.0, min_p: 0.0, seed: 2 };
        let mut s = Sampler::new(cfg);
        let picks: Vec<u32> = (0..300).map(|_| s.sample(&logits)).collect();
        assert!(picks.iter().all(|&t| t < 3), "{picks:?}");
        assert!((0..3).all(|id| picks.contains(&id)));
        // Greedy, and top-k 1 at any temperature: the first of the largest.
        assert_eq!(argmax(&logits), 0);
        let cfg = SamplerConfig { temperature: 2.0, top_k: 1, ..Default::default() };
        assert_eq!(Sampler::new(cfg).sample(&logits), 0);
        // -0 sorts after +0 (f32::total_cmp); both weigh the same.
        let logits = [-0.0f32, 0.0, -1e3];
        let s = DeviceSample { temperature: 1.0, top_k: 1, top_p: 1.0, min_p: 0.0, r: 0.5 };
        assert_eq!(pick(&logits, &s), 1);
    }

    #[test]
    fn non_finite_logits_are_never_candidates() {
        let hot = DeviceSample { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, r: 0.999 };
        // Nothing finite: the argmax, the lowest id when nothing is above -inf.
        assert_eq!(pick(&[f32::NEG_INFINITY; 4], &hot), 0);
        assert_eq!(pick(&[f32::NAN; 4], &hot), 0);
        assert_eq!(pick(&[f32::NAN, f32::NEG_INFINITY, f32::INFINITY, f32::NAN], &hot), 2);
        // +inf, NaN and -inf are left out; the finite ones are sampled.
        let logits = [f32::INFINITY, 0.0, f32::NAN, 0.0, f32::NEG_INFINITY];
        for r in [0.0, 0.25, 0.5, 0.75, 0.999] {
            let t = pick(&logits, &DeviceSample { r, ..hot });
            assert!(t == 1 || t == 3, "r {r}: {t}");
        }
        assert_eq!(argmax(&logits), 0);
        // The generator advances once per token at temperature > 0, whatever the logits, so a
        // device sampler (which draws before it sees them) stays in step with the host.
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 4 };
        let good: Vec<f32> = (0..50).map(|i| (i % 7) as f32).collect();
        let mut a = Sampler::new(cfg);
        let mut b = Sampler::new(cfg);
        a.sample(&[f32::NAN; 50]);
        b.sample(&good);
        assert_eq!(a.sample(&good), b.sample(&good));
        // Greedy draws nothing.
        let mut g = Sampler::new(SamplerConfig { seed: 4, ..Default::default() });
        assert_eq!(g.draw(), DeviceSample::GREEDY);
        assert_eq!(g.state, Sampler::new(SamplerConfig { seed: 4, ..Default::default() }).state);
    }

    #[test]
    fn a_draw_then_pick_is_sample() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 7919) % 101) as f32 * 0.05).collect();
        let cfg = SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, seed: 3 };
        let mut a = Sampler::new(cfg);
        let mut b = Sampler::new(cfg);
        for _ in 0..100 {
            let d = b.draw();
            assert!((0.0..1.0).contains(&d.r) && d.top_k == 40);
            assert_eq!(a.sample(&logits), pick(&logits, &d));
        }
    }

    /// The steps of the CUDA kernel (kernels/sample.cu), on the host: a radix select of the K-th
    /// largest order key 8 bits at a time, the gather (every key above it, the lowest ids equal
    /// to it), a sort of `key << 32 | !id` descending, the weights, prefix sums, and the cut as
    /// `min(a, b + 1)`. Whatever the kernel's bugs, its algorithm must pick what `pick` picks.
    fn kernel_steps(logits: &[f32], s: &DeviceSample) -> u32 {
        if s.is_greedy() {
            return argmax(logits);
        }
        let order_key = |v: f32| {
            let b = v.to_bits();
            if b & 0x8000_0000 != 0 {
                !b
            } else {
                b | 0x8000_0000
            }
        };
        let finite: Vec<(u32, u32)> =
            logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (order_key(v), i as u32)).collect();
        let k = (s.candidates() as usize).min(finite.len());
        if k == 0 {
            return argmax(logits);
        }
        let (mut threshold, mut mask, mut remaining, mut n_eq) = (0u32, 0u32, k, 0);
        for shift in [24, 16, 8, 0] {
            let mut hist = [0usize; 256];
            for &(key, _) in &finite {
                if key & mask == threshold {
                    hist[((key >> shift) & 255) as usize] += 1;
                }
            }
            let (mut above, mut d) = (0, 255);
            while d > 0 && above + hist[d] < remaining {
                above += hist[d];
                d -= 1;
            }
            threshold |= (d as u32) << shift;
            mask |= 255 << shift;
            remaining -= above;
            n_eq = hist[d];
        }
        assert!(remaining >= 1 && n_eq >= remaining);
        let mut cand = Vec::with_capacity(k);
        let mut eq_taken = 0;
        for &(key, i) in &finite {
            let take = key > threshold || (key == threshold && eq_taken < remaining);
            eq_taken += (key == threshold) as usize;
            if take {
                cand.push(((key as u64) << 32) | !i as u64);
            }
        }
        assert_eq!(cand.len(), k);
        cand.sort_unstable_by(|a, b| b.cmp(a));
        let id = |c: u64| !(c as u32);
        let max = logits[id(cand[0]) as usize];
        let prob: Vec<f32> =
            cand.iter().map(|&c| crate::numerics::exp((logits[id(c) as usize] - max) / s.temperature)).collect();
        let mut prefix = Vec::with_capacity(k);
        let mut acc = 0.0f32;
        for &p in &prob {
            acc += p;
            prefix.push(acc);
        }
        let sum = prefix[k - 1];
        let min_prob = prob[0] / sum * s.min_p;
        let mut kept = k;
        for c in 0..k {
            if c > 0 && prob[c] / sum < min_prob {
                kept = kept.min(c);
            }
            if prefix[c] / sum >= s.top_p {
                kept = kept.min(c + 1);
            }
        }
        let mut r = s.r * prefix[kept - 1];
        for (c, &p) in prob[..kept].iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                return id(cand[c]);
            }
        }
        id(cand[kept - 1])
    }

    /// Logits with many ties (a few values repeated), with NaN, infinities and signed zeros mixed
    /// in, or any bit pattern at all.
    fn tie_heavy_logits(max_len: usize) -> impl proptest::strategy::Strategy<Value = Vec<f32>> {
        let value = prop_oneof![
            6 => (0u32..12).prop_map(|i| i as f32 * 0.75 - 4.0),
            2 => -30.0f32..30.0,
            1 => proptest::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 3.4e38, -3.4e38]),
            1 => any_f32(),
        ];
        proptest::collection::vec(value, 1..max_len)
    }

    fn any_draw() -> impl proptest::strategy::Strategy<Value = DeviceSample> {
        let t = proptest::sample::select(vec![0.0f32, 0.3, 0.8, 1.5, 1e-30, 1e30, f32::INFINITY]);
        let k = proptest::sample::select(vec![0u32, 1, 2, 3, 40, 1023, 1024, 1025, 5000]);
        let p = prop_oneof![proptest::sample::select(vec![1.0f32, 0.9, 0.3, 0.0]), 0.0f32..1.0];
        let m = prop_oneof![proptest::sample::select(vec![0.0f32, 0.05, 1.0]), 0.0f32..1.0];
        (t, k, p, m, 0u32..(1 << 24)).prop_map(|(temperature, top_k, top_p, min_p, r)| DeviceSample {
            temperature,
            top_k,
            top_p,
            min_p,
            r: r as f32 / (1u32 << 24) as f32,
        })
    }

    /// Any f32 bit pattern: NaN, infinities, subnormals, negative zero and huge values included.
    fn any_f32() -> impl proptest::strategy::Strategy<Value = f32> {
        proptest::prelude::any::<u32>().prop_map(f32::from_bits)
    }

    use proptest::prelude::*;

    proptest! {
        /// The checks accept exactly their documented ranges.
        #[test]
        fn checks_accept_exactly_their_ranges(t in any_f32(), p in any_f32(), m in any_f32()) {
            prop_assert_eq!(check_temperature(t).is_ok(), t.is_finite() && t >= 0.0);
            prop_assert_eq!(check_top_p(p).is_ok(), (0.0..=1.0).contains(&p));
            prop_assert_eq!(check_min_p(m).is_ok(), (0.0..=1.0).contains(&m));
            let cfg = SamplerConfig { temperature: t, top_k: 0, top_p: p, min_p: m, seed: 0 };
            prop_assert_eq!(cfg.validate().is_ok(), check_temperature(t).is_ok() && check_top_p(p).is_ok()
                && check_min_p(m).is_ok());
        }

        /// The kernel's formulation (radix select, gather, sort, parallel cut) picks the same
        /// token as the definition, ties and non-finite logits included.
        #[test]
        fn the_kernel_steps_pick_what_the_definition_picks(logits in tie_heavy_logits(3000), s in any_draw()) {
            prop_assert_eq!(kernel_steps(&logits, &s), pick(&logits, &s));
        }

        /// Whatever the settings and logits (NaN and infinite ones too), sampling returns an id
        /// inside the vocabulary and never panics.
        #[test]
        fn sampling_never_panics(t in any_f32(), p in any_f32(), m in any_f32(), k in 0usize..1000,
                                 seed in any::<u64>(), logits in proptest::collection::vec(any_f32(), 1..64)) {
            let mut s = Sampler::new(SamplerConfig { temperature: t, top_k: k, top_p: p, min_p: m, seed });
            for _ in 0..4 {
                prop_assert!((s.sample(&logits) as usize) < logits.len());
            }
        }
    }
}
