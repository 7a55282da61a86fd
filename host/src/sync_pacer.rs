//! `--min-sync-period`: how often cluster changes may reach the model, the guests and the
//! kernel, as kube-proxy's `minSyncPeriod` bounds its syncs.
//!
//! Without it the host applies whatever queued while the previous change was applied: a
//! change on a quiet node costs one transaction at once, and a burst costs as many as the
//! transactions' own time allows. With it, changes are applied at most once per period on
//! average, in bursts of at most [`BURST`] (kube-proxy's `BoundedFrequencyRunner`: a token
//! bucket of `burstSyncs = 2`), and what arrives meanwhile waits and goes in as one batch.
//! The first change after a quiet period is still applied at once. That trades latency under
//! churn for fewer revisions and transactions, which is what the setting is for on large
//! clusters.

use std::time::{Duration, Instant};

/// Applies allowed back to back after a quiet period (kube-proxy's `burstSyncs`).
pub const BURST: u32 = 2;

/// A token bucket of [`BURST`] applies, refilled at one per period.
#[derive(Debug, Clone)]
pub struct SyncPacer {
    period: Duration,
    tokens: f64,
    refilled_at: Instant,
}

impl SyncPacer {
    /// A full bucket: the first [`BURST`] applies do not wait. A zero period never waits.
    pub fn new(period: Duration, now: Instant) -> SyncPacer {
        SyncPacer { period, tokens: f64::from(BURST), refilled_at: now }
    }

    fn refill(&mut self, now: Instant) {
        if self.period.is_zero() {
            return;
        }
        let earned = now.saturating_duration_since(self.refilled_at).as_secs_f64() / self.period.as_secs_f64();
        self.tokens = (self.tokens + earned).min(f64::from(BURST));
        self.refilled_at = now;
    }

    /// How long the next apply must wait from `now` (zero: it may run now).
    pub fn delay(&mut self, now: Instant) -> Duration {
        if self.period.is_zero() {
            return Duration::ZERO;
        }
        self.refill(now);
        if self.tokens >= 1.0 { Duration::ZERO } else { self.period.mul_f64(1.0 - self.tokens) }
    }

    /// An apply started at `now`.
    pub fn ran(&mut self, now: Instant) {
        if self.period.is_zero() {
            return;
        }
        self.refill(now);
        self.tokens = (self.tokens - 1.0).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(1);

    /// Runs applies as soon as the pacer allows, one per queued change, and returns their
    /// start times relative to `t0`.
    fn schedule(pacer: &mut SyncPacer, t0: Instant, arrivals: &[Duration]) -> Vec<Duration> {
        let mut now = t0;
        let mut starts = Vec::new();
        for &arrival in arrivals {
            now = now.max(t0 + arrival);
            now += pacer.delay(now);
            pacer.ran(now);
            starts.push(now - t0);
        }
        starts
    }

    #[test]
    fn a_zero_period_never_waits() {
        let t0 = Instant::now();
        let mut pacer = SyncPacer::new(Duration::ZERO, t0);
        for _ in 0..100 {
            assert_eq!(pacer.delay(t0), Duration::ZERO);
            pacer.ran(t0);
        }
    }

    #[test]
    fn a_burst_runs_at_once_then_one_per_period() {
        let t0 = Instant::now();
        let mut pacer = SyncPacer::new(PERIOD, t0);
        let starts = schedule(&mut pacer, t0, &[Duration::ZERO; 5]);
        let ms: Vec<u128> = starts.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [0, 0, 1000, 2000, 3000]);
    }

    #[test]
    fn a_quiet_period_refills_the_burst_and_no_more() {
        let t0 = Instant::now();
        let mut pacer = SyncPacer::new(PERIOD, t0);
        schedule(&mut pacer, t0, &[Duration::ZERO; 2]);
        // Ten quiet periods later: two at once again, not ten.
        let later = t0 + 10 * PERIOD;
        let starts = schedule(&mut pacer, later, &[Duration::ZERO; 3]);
        let ms: Vec<u128> = starts.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [0, 0, 1000]);
    }

    #[test]
    fn a_partly_refilled_bucket_waits_only_the_rest() {
        let t0 = Instant::now();
        let mut pacer = SyncPacer::new(PERIOD, t0);
        schedule(&mut pacer, t0, &[Duration::ZERO; 2]);
        assert_eq!(pacer.delay(t0 + Duration::from_millis(400)).as_millis(), 600);
        assert_eq!(pacer.delay(t0 + Duration::from_millis(1000)), Duration::ZERO);
    }
}
