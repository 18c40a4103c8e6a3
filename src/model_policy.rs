//! How an agent calls its model: a timeout per attempt, and retries with backoff.

use std::time::Duration;

/// How an agent's model is called: the timeout of each attempt, and which failures are tried
/// again, how often, and after how long.
///
/// An attempt that fails with a [retryable](crate::ModelError::retryable) error (a rate
/// limit, a 5xx, a dropped connection) or that outlasts [`timeout`](Self::timeout) is tried
/// again after a backoff, until [`max_attempts`](Self::max_attempts) attempts were made; a
/// [fatal](crate::ModelError::fatal) error fails the run at once. Each attempt is a
/// `step.model_started` in the run's log, and each failed attempt that is tried again a
/// `step.model_attempt_failed`, written as it happens: a crash in the middle of the retries
/// leaves them as they were, and the run's next executor goes on from the last attempt.
///
/// The backoff before attempt `n + 1` is exponential, `initial_backoff * 2^(n-1)` capped at
/// `max_backoff`, less a random part of up to a half (so that runs that failed together do
/// not retry together); a server's `Retry-After` is waited for in full when it is longer,
/// unless it asks for more than `max_retry_after`: the run then fails rather than wait.
///
/// The worst case before a run fails for want of an answer, with the defaults, is three
/// attempts that each time out: about 30 minutes. A shorter timeout suits a fast hosted
/// model; a reasoning model or a slow local one may need the default, or no timeout.
///
/// ```
/// use std::time::Duration;
/// use agentrt::ModelPolicy;
///
/// let policy = ModelPolicy::default()
///     .timeout(Duration::from_secs(30))
///     .max_attempts(6)
///     .backoff(Duration::from_millis(200), Duration::from_secs(10));
/// assert_eq!(policy.max_attempts_allowed(), 6);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelPolicy {
    timeout: Option<Duration>,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    max_retry_after: Duration,
}

/// The default per-attempt timeout, 10 minutes: long enough for a long answer from a
/// reasoning model or a slow local one, short enough that a hung connection ends.
pub const DEFAULT_MODEL_TIMEOUT: Duration = Duration::from_secs(600);

impl Default for ModelPolicy {
    /// A 10-minute timeout per attempt; 3 attempts; backoff from 500 ms doubling up to 30 s;
    /// a `Retry-After` of up to 60 s honoured.
    fn default() -> Self {
        ModelPolicy {
            timeout: Some(DEFAULT_MODEL_TIMEOUT),
            max_attempts: 3,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl ModelPolicy {
    /// One attempt, no timeout: a model error fails the run at once, as a model call did
    /// before policies existed.
    pub fn no_retries() -> Self {
        ModelPolicy {
            timeout: None,
            max_attempts: 1,
            ..ModelPolicy::default()
        }
    }

    /// Each attempt may take at most `timeout` (zero means [`DEFAULT_MODEL_TIMEOUT`]); one
    /// that takes longer is dropped and counts as a retryable failure. The server may still
    /// finish, and bill, the request it was sent.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(if timeout.is_zero() {
            DEFAULT_MODEL_TIMEOUT
        } else {
            timeout
        });
        self
    }

    /// No limit on an attempt's duration.
    pub fn without_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }

    /// The most attempts of one model call, the first included (at least 1). Attempts that
    /// a crash interrupted count too.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff after the first failed attempt, and the most it grows to.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// The longest `Retry-After` waited for; a server asking for longer fails the run.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The timeout of each attempt, if any.
    pub fn attempt_timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The most attempts of one model call.
    pub fn max_attempts_allowed(&self) -> u32 {
        self.max_attempts
    }

    /// The longest wait between two attempts the policy allows.
    pub(crate) fn longest_wait(&self) -> Duration {
        self.max_backoff.max(self.max_retry_after)
    }

    /// How long to wait before the attempt after `attempt` failed retryably; `Err(None)`
    /// when that was the last attempt allowed, `Err(Some(why))` when the policy refuses to
    /// wait as asked. `retry_after` is the server's hint; `unit` a random number in `[0, 1)`.
    pub(crate) fn next_attempt(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        unit: f64,
    ) -> Result<Duration, Option<String>> {
        if attempt >= self.max_attempts {
            return Err(None);
        }
        if let Some(after) = retry_after
            && after > self.max_retry_after
        {
            return Err(Some(format!(
                "the server asked to wait {} s, longer than the policy's {} s",
                after.as_secs_f64(),
                self.max_retry_after.as_secs_f64()
            )));
        }
        let doublings = attempt.saturating_sub(1).min(31);
        let full = self
            .initial_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff);
        // "Equal jitter": never less than half the backoff, never more than all of it.
        let backoff = full / 2 + full.mul_f64(unit.clamp(0.0, 1.0) / 2.0);
        // The server's wait, but never less than the policy's own: a `Retry-After: 0` sent to
        // many runs at once must not bring them all back at once.
        Ok(retry_after.map_or(backoff, |after| after.max(backoff)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_up_to_its_cap_and_keeps_at_least_half() {
        let policy = ModelPolicy::default()
            .max_attempts(10)
            .backoff(Duration::from_millis(100), Duration::from_millis(1000));
        let at = |attempt, unit| policy.next_attempt(attempt, None, unit).unwrap();
        assert_eq!(at(1, 0.0), Duration::from_millis(50));
        let most = at(1, 0.999_999);
        assert!(most > Duration::from_micros(99_990) && most < Duration::from_millis(100));
        assert_eq!(at(2, 0.0), Duration::from_millis(100));
        assert_eq!(at(3, 0.0), Duration::from_millis(200));
        assert_eq!(at(5, 0.0), Duration::from_millis(500));
        assert_eq!(at(9, 0.5), Duration::from_millis(750));
    }

    #[test]
    fn a_retry_after_is_waited_in_full_unless_it_exceeds_the_cap() {
        let policy = ModelPolicy::default().max_retry_after(Duration::from_secs(5));
        let hint = Some(Duration::from_secs(3));
        assert_eq!(
            policy.next_attempt(1, hint, 0.0),
            Ok(Duration::from_secs(3))
        );
        let too_long = policy.next_attempt(1, Some(Duration::from_secs(6)), 0.0);
        assert!(
            too_long
                .unwrap_err()
                .unwrap()
                .contains("longer than the policy's 5 s")
        );
    }

    #[test]
    fn the_last_attempt_gives_up() {
        let policy = ModelPolicy::default().max_attempts(3);
        assert!(policy.next_attempt(2, None, 0.0).is_ok());
        assert_eq!(policy.next_attempt(3, None, 0.0), Err(None));
        assert_eq!(
            ModelPolicy::no_retries().next_attempt(1, None, 0.0),
            Err(None)
        );
    }
}
