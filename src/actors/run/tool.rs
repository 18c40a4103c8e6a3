//! The tool call step: run a started call, within its timeout and its heartbeats' keeping its
//! progress, and record its outcome (paired with the move that follows it) or its timeout.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    time::Duration,
};

use actix_rt::time::{Instant, sleep_until};
use futures_util::FutureExt;
use serde_json::Value;
use tokio::sync::watch;
use tracing::Instrument;

use super::run_loop::{Next, RunLoop};
use crate::{
    agent::{Beat, Cancellation, Heart, Tool, ToolContext, ToolError},
    error::{Error, Result},
    metrics,
    store::{
        backend::Durability,
        model::{StepRow, idempotency_key},
        moves::{FinishTool, RecordProgress, TimeOutTool, TimedOut, WaitRequest},
    },
    types::{FencingToken, LeaseLostReason, StepKind, StepState, ToolCall, ToolResult},
};

/// How a call of a tool ended.
enum Ran {
    /// It returned (or panicked), with the time it asked to be called again at, if any.
    Returned(
        std::thread::Result<Result<Value, ToolError>>,
        Option<(std::time::SystemTime, String)>,
    ),
    /// Its signal fired for its timeout, and it did not return within the grace: it was dropped.
    TimedOut {
        why: TimedOut,
        limit: Duration,
        /// The latest heartbeat value not handed to a write yet: the timeout's move keeps it.
        unkept: Option<Value>,
        /// The latest heartbeat value, kept or not.
        latest: Option<Value>,
    },
}

impl RunLoop {
    /// Runs a started tool call and records its outcome, with the move that follows it; or,
    /// when it timed out, marks its step interrupted for the loop to reconcile.
    pub(super) async fn call_tool(&mut self, step: &StepRow) -> Result<Next> {
        let call = step.call.clone().expect("tool steps have a call");
        let (number, attempt) = (step.step, step.attempt);
        // The start was written under the lease, but its answer came back after the deadline
        // (the process stalled, or the network held the answer up): by now another process may
        // have taken the run over. The call is not made; the takeover reconciles the step.
        if self.grant().remaining().is_zero() {
            tracing::warn!(step = number, tool = %call.name, "the lease expired before the tool could start");
            return Err(Error::LeaseLost {
                run_id: self.run_id().clone(),
                reason: LeaseLostReason::Expired,
            });
        }
        let span = tracing::info_span!(
            "tool",
            step = i64::from(number),
            tool = %call.name,
            call_id = %call.id,
            attempt = i64::from(attempt),
            fencing_token = self.grant().token() as i64,
            otel.name = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        span.record("otel.name", format!("execute_tool {}", call.name));
        let registered = self.agent().tools.get(&call.name).cloned();
        let wait = registered.as_ref().and_then(|t| t.wait.clone());
        let result = match registered.map(|t| t.tool.clone()) {
            // A built-in tool's call waits; arguments that cannot make a wait are its error.
            Some(_) if wait.is_some() => {
                let wait = wait.expect("a built-in tool");
                match wait.request(&call.args, self.now_millis()) {
                    Ok(request) => return self.begin_wait(step, &call, request).await,
                    Err(error) => ToolResult::Error(error),
                }
            }
            // The agent was registered again without this tool since the call started.
            None => {
                metrics::tool_failed();
                ToolResult::Error(format!("the agent has no tool named {:?}", call.name))
            }
            Some(tool) => {
                let started = std::time::Instant::now();
                let ran = self.run_tool(&*tool, step, &call, span).await;
                metrics::step_took(StepKind::Tool, started.elapsed());
                let outcome = match ran {
                    // The tool asked to be called again at a time: the run waits for it.
                    Ran::Returned(Ok(Err(_)), Some((at, reason))) => {
                        let request = WaitRequest::Timer {
                            at: crate::clock::to_millis(at),
                            reason,
                            retry: true,
                        };
                        return self.begin_wait(step, &call, request).await;
                    }
                    Ran::Returned(outcome, _) => outcome,
                    Ran::TimedOut {
                        why,
                        limit,
                        unkept,
                        latest,
                    } => {
                        metrics::tool_failed();
                        return self
                            .timed_out(step, &call, why, limit, unkept, latest)
                            .await;
                    }
                };
                if !matches!(outcome, Ok(Ok(_))) {
                    metrics::tool_failed();
                }
                match outcome
                    .map_err(|panic| self.panicked(number, format!("tool {}", call.name), panic))?
                {
                    Ok(output) => ToolResult::Ok(output),
                    Err(error) => ToolResult::Error(error.0),
                }
            }
        };
        let first = FinishTool::new(self.leased(), number, attempt, &call.id, &result);
        let result_json = first.result.value().clone();
        self.set_step(number, StepState::Finished, attempt, Some(result_json));
        // A lost lease or an operator's cancel (both fire the signal) plans nothing more: the
        // outcome alone is offered. So does a drain, which then hands the run over.
        let next = if self.cancellation().is_cancelled() || self.draining() {
            Ok(None)
        } else {
            self.plan()
        };
        // A late outcome (an operator cancelled the run) is followed by nothing.
        let (late, next) = self.commit_with(first, next, |late| !late).await?;
        if late {
            return self.cancelled().await.map(Next::Return);
        }
        next
    }

    /// Calls `tool` and waits for it to return, within its limits: past its timeout, or once
    /// its heartbeats stop, its own signal fires (not the run's); if it has not returned the
    /// agent's grace later, it is dropped. Meanwhile its heartbeats are kept, at most once
    /// per the agent's period. A cancel or a lost lease fires its signal too, and the call is
    /// awaited as before, within the same limits.
    async fn run_tool(
        &self,
        tool: &dyn Tool,
        step: &StepRow,
        call: &ToolCall,
        span: tracing::Span,
    ) -> Ran {
        let agent = self.agent();
        let limit = agent.timeout_of(tool);
        let beat_limit = tool.heartbeat_timeout().filter(|limit| !limit.is_zero());
        let signal = self.cancellation().child();
        let (heart, mut beats) = Heart::new();
        let ctx = self.tool_context(step, call, signal.clone(), heart);
        let mut returned = pin!(
            AssertUnwindSafe(tool.call(&ctx, &call.args))
                .catch_unwind()
                .instrument(span)
        );
        let mut progress = Progress::new(agent.progress_every);
        let started = Instant::now();
        // Far enough never to come: a branch whose condition is false still builds its timer.
        let never = started + Duration::from_secs(86_400 * 365);
        let deadline = started.checked_add(limit).unwrap_or(never);
        let mut last_beat = started;
        // Once the signal fired for a limit: why, which limit, and when the call is dropped.
        let mut fired: Option<(TimedOut, Duration, Instant)> = None;
        // A drain's deadline passed: the signal fired, the call is awaited within its limits.
        let mut cut = false;
        loop {
            let beat_deadline = beat_limit
                .and_then(|limit| last_beat.checked_add(limit))
                .unwrap_or(never);
            let drop_at = fired.map_or(never, |(.., at)| at);
            let write_at = progress.next_write().unwrap_or(never);
            let fire = tokio::select! {
                biased;
                outcome = &mut returned => {
                    let again = ctx.again.lock().unwrap_or_else(|e| e.into_inner()).take();
                    return Ran::Returned(outcome, again);
                }
                () = sleep_until(drop_at), if fired.is_some() => {
                    let (why, limit, _) = fired.expect("fired");
                    let (unkept, latest) = progress.left();
                    return Ran::TimedOut { why, limit, unkept, latest };
                }
                () = sleep_until(deadline), if fired.is_none() => {
                    Some((TimedOut::Timeout, limit))
                }
                // The writes come before the beats: a tool that beats without pause from a
                // thread of its own still has its progress kept.
                kept = progress.written(), if progress.writing.is_some() => {
                    progress.answered(kept);
                    None
                }
                () = sleep_until(write_at), if progress.next_write().is_some() => {
                    let (step, attempt) = (step.step, step.attempt);
                    progress.write(|value| {
                        let record = RecordProgress { by: self.leased(), step, attempt, progress: value };
                        // Only a hint for the next attempt: answered once written, made
                        // durable by the next commit, never a sync of its own.
                        Box::pin(self.store().apply(record, Durability::Written))
                    });
                    None
                }
                changed = beats.changed() => {
                    // The context holds the sender until the call is dropped.
                    if changed.is_ok() {
                        last_beat = Instant::now();
                        progress.beaten(&beats.borrow_and_update());
                    }
                    None
                }
                () = sleep_until(beat_deadline), if fired.is_none() && beat_limit.is_some() => {
                    Some((TimedOut::Heartbeat, beat_limit.unwrap_or_default()))
                }
                () = self.drain_cut(), if !cut => {
                    tracing::warn!(
                        step = step.step,
                        tool = %call.name,
                        call_id = %call.id,
                        "the drain's deadline passed with the tool call running: its cancellation signal fired"
                    );
                    cut = true;
                    signal.fire();
                    None
                }
            };
            if let Some((why, limit)) = fire {
                tracing::warn!(
                    step = step.step,
                    tool = %call.name,
                    call_id = %call.id,
                    attempt = step.attempt,
                    why = why.as_str(),
                    limit_ms = limit.as_millis() as u64,
                    grace_ms = agent.tool_grace.as_millis() as u64,
                    "the tool call ran past its limit: its cancellation signal fired"
                );
                signal.fire();
                let at = Instant::now()
                    .checked_add(agent.tool_grace)
                    .unwrap_or(never);
                fired = Some((why, limit, at));
            }
        }
    }

    /// Records that the call of `step` timed out, and marks the step interrupted: the loop
    /// then reconciles it as a takeover's interrupted call.
    async fn timed_out(
        &mut self,
        step: &StepRow,
        call: &ToolCall,
        why: TimedOut,
        limit: Duration,
        unkept: Option<Value>,
        latest: Option<Value>,
    ) -> Result<Next> {
        let (number, attempt) = (step.step, step.attempt);
        tracing::warn!(
            step = number,
            tool = %call.name,
            call_id = %call.id,
            attempt,
            why = why.as_str(),
            grace_ms = self.agent().tool_grace.as_millis() as u64,
            "the tool call did not return within the grace after its signal fired: dropped, \
             and reconciled as an interrupted call"
        );
        self.commit(TimeOutTool {
            by: self.leased(),
            step: number,
            attempt,
            call_id: call.id.clone(),
            why,
            limit,
            progress: unkept,
        })
        .await?;
        self.set_step(number, StepState::Interrupted, attempt, None);
        if let Some(latest) = latest {
            self.set_progress(number, latest);
        }
        Ok(Next::Continue)
    }

    /// What a tool is told of attempt `step.attempt` of `call`: `cancellation` is its signal,
    /// `heart` takes its heartbeats, and the progress an earlier attempt kept is the step's.
    pub(super) fn tool_context(
        &self,
        step: &StepRow,
        call: &ToolCall,
        cancellation: Cancellation,
        heart: Heart,
    ) -> ToolContext {
        ToolContext {
            run_id: self.run_id().clone(),
            step: step.step,
            call_id: call.id.clone(),
            attempt: step.attempt,
            idempotency_key: idempotency_key(self.run_id(), step.step),
            fencing_token: FencingToken::new(self.grant().token()),
            cancellation,
            progress: step.progress.clone(),
            heart,
            again: Default::default(),
        }
    }
}

/// A progress write in flight.
type Writing = Pin<Box<dyn Future<Output = Result<()>>>>;

/// The heartbeats of one call as the loop keeps them: the latest value, written at most once
/// per period, one write at a time.
struct Progress {
    every: Duration,
    /// The latest value beaten, with the beat that carried it.
    latest: Option<(u64, Value)>,
    /// The beat whose value was last handed to a write (0: none).
    handed: u64,
    /// When the last write was handed its value.
    last_write: Option<Instant>,
    writing: Option<Writing>,
    /// A write was refused: nothing more is written.
    stopped: bool,
}

impl Progress {
    fn new(every: Duration) -> Self {
        Progress {
            every,
            latest: None,
            handed: 0,
            last_write: None,
            writing: None,
            stopped: false,
        }
    }

    /// A beat came: `beat` is the latest.
    fn beaten(&mut self, beat: &watch::Ref<'_, Beat>) {
        if let Some((number, value)) = &beat.progress
            && self.latest.as_ref().is_none_or(|(seen, _)| seen < number)
        {
            self.latest = Some((*number, value.clone()));
        }
    }

    /// When the next write may begin, if there is a value to write: a period after the last
    /// one began, and once it is answered.
    fn next_write(&self) -> Option<Instant> {
        let (number, _) = self.latest.as_ref()?;
        if self.stopped || self.writing.is_some() || *number <= self.handed {
            return None;
        }
        Some(match self.last_write {
            Some(last) => last.checked_add(self.every).unwrap_or(last),
            None => Instant::now(),
        })
    }

    /// Begins writing the latest value with the write `write` makes of it.
    fn write(&mut self, write: impl FnOnce(Value) -> Writing) {
        if let Some((number, value)) = &self.latest {
            self.handed = *number;
            self.last_write = Some(Instant::now());
            self.writing = Some(write(value.clone()));
        }
    }

    /// Completes when the write in flight is answered (never if none is).
    async fn written(&mut self) -> Result<()> {
        match &mut self.writing {
            Some(writing) => writing.await,
            None => std::future::pending().await,
        }
    }

    /// The write in flight was answered with `kept`.
    fn answered(&mut self, kept: Result<()>) {
        self.writing = None;
        match kept {
            Ok(()) => {}
            // Refused (the lease is lost, the run cancelled): nothing more of this attempt can
            // be kept.
            Err(err) if err.is_run_state() || matches!(err, Error::LeaseLost { .. }) => {
                tracing::debug!(%err, "a tool's progress was refused; no more is kept");
                self.stopped = true;
            }
            // The store failed: the latest value is written again a period later.
            Err(err) => {
                tracing::warn!(%err, "a tool's progress could not be kept; trying again");
                self.handed = 0;
            }
        }
    }

    /// The latest value not handed to a write yet, and the latest value.
    fn left(&self) -> (Option<Value>, Option<Value>) {
        match &self.latest {
            Some((number, value)) if *number > self.handed => {
                (Some(value.clone()), Some(value.clone()))
            }
            Some((_, value)) => (None, Some(value.clone())),
            None => (None, None),
        }
    }
}
