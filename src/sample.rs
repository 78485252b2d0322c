//! Token sampling over host logits: greedy at temperature 0, otherwise temperature with top-k,
//! top-p and min-p filters, from a seeded generator so runs are reproducible.

/// Sampling knobs. `top_k == 0` keeps every token; `top_p == 1` and `min_p == 0` disable those filters.
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
}

/// The index of the largest finite logit (the first one on ties); 0 if none is finite.
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

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        // A zero xorshift state would stay zero; mix the seed first.
        let state = cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
        Sampler { cfg, state: state.max(1), candidates: Vec::new() }
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

    /// Picks the next token from `logits`. Settings outside their ranges (see
    /// [`SamplerConfig::validate`]) are clamped here so sampling never panics, but callers are
    /// expected to refuse them first.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let c = self.cfg;
        if c.temperature.is_nan() || c.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let top_p = if c.top_p.is_nan() { 1.0 } else { c.top_p.clamp(0.0, 1.0) };
        let min_p = if c.min_p.is_nan() { 0.0 } else { c.min_p.clamp(0.0, 1.0) };

        let mut cand = std::mem::take(&mut self.candidates);
        cand.clear();
        cand.extend(logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (v, i as u32)));
        if cand.is_empty() {
            self.candidates = cand;
            return argmax(logits);
        }
        // Descending by logit, lower id first on ties.
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, by_logit);
            cand.truncate(c.top_k);
        }
        cand.sort_unstable_by(by_logit);

        let max = cand[0].0;
        let probs: Vec<f32> = cand.iter().map(|&(v, _)| ((v - max) / c.temperature).exp()).collect();
        let sum: f32 = probs.iter().sum();
        let min_prob = probs[0] / sum * min_p;
        let mut kept = 0;
        let mut kept_sum = 0.0f32;
        for (i, &p) in probs.iter().enumerate() {
            if i > 0 && p / sum < min_prob {
                break;
            }
            kept += 1;
            kept_sum += p;
            if kept_sum / sum >= top_p {
                break;
            }
        }
        let mut r = self.next_f32() * kept_sum;
        let mut pick = cand[kept - 1].1;
        for (i, &p) in probs[..kept].iter().enumerate() {
            r -= p;
            if r <= 0.0 {
                pick = cand[i].1;
                break;
            }
        }
        self.candidates = cand;
        pick
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
