//! Starting the runs of schedules: a supervisor with recovery reads, at each recovery pass and
//! at the time of the next occurrence it knows of, the due schedules of its agents through
//! their index; advances each (one replica wins each occurrence) and executes the run it
//! inserted, as a run that waited for a slot.

use std::{collections::HashSet, time::Duration};

use actix::{ActorFutureExt, AsyncContext, Context, SpawnHandle, WrapFuture};

use super::Supervisor;
use crate::{
    actors::{run::Job, store::ReadState},
    clock::to_millis,
    cron::Cron,
    schedule,
    store::{
        backend::Durability,
        model::ScheduleRow,
        moves::{AdvanceSchedule, Advanced},
    },
};

/// The most due schedules one pass advances: a full page makes another pass at once.
const PASS_LIMIT: usize = 256;

/// The longest a supervisor goes without a pass while it knows of a schedule: one put or
/// resumed elsewhere, or a test clock that runs faster than time, is found by then.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// What a supervisor keeps of the schedules it starts.
#[derive(Default)]
pub(super) struct Scheduling {
    /// A pass is reading.
    reading: bool,
    /// The next pass this supervisor set, and the time (by `Config::clock`) it is for.
    next: Option<(i64, SpawnHandle)>,
    /// The schedules whose advance is being written: a pass that reads one again before it
    /// commits leaves it alone.
    advancing: HashSet<String>,
}

impl Supervisor {
    /// Advances the due schedules of this supervisor's agents (a supervisor with recovery),
    /// executes the runs it started, and sets a pass for the next occurrence it finds.
    pub(super) fn schedule_pass(&mut self, ctx: &mut Context<Self>) {
        if self.recovery.is_none() || self.scheduling.reading || self.draining.is_on() {
            return;
        }
        self.scheduling.reading = true;
        let agents: Vec<String> = self.agents.keys().cloned().collect();
        let now = to_millis(self.clock.now());
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let agents: Vec<&str> = agents.iter().map(String::as_str).collect();
            let due = reads.due_schedules(now, &agents, PASS_LIMIT)?;
            let next = reads.next_scheduled_at(now, &agents)?;
            Ok((due, next))
        }));
        let pass = read.into_actor(self).map(move |read, this, ctx| {
            this.scheduling.reading = false;
            let (due, next) = match read {
                Ok(Ok(found)) => found,
                Ok(Err(err)) => {
                    tracing::warn!(%err, "could not read the schedules that are due");
                    return;
                }
                Err(_) => return,
            };
            let full = due.len() >= PASS_LIMIT;
            for row in due {
                this.advance(row, now, ctx);
            }
            if full {
                this.schedule_at(now, ctx);
            } else if let Some(next) = next {
                this.schedule_at(next, ctx);
            }
        });
        ctx.spawn(pass);
    }

    /// Sets a pass for time `at` (by `Config::clock`), unless one is set before it; in any
    /// case within [`MAX_SLEEP`].
    fn schedule_at(&mut self, at: i64, ctx: &mut Context<Self>) {
        if self
            .scheduling
            .next
            .as_ref()
            .is_some_and(|(next, _)| *next <= at)
        {
            return;
        }
        if let Some((_, handle)) = self.scheduling.next.take() {
            ctx.cancel_future(handle);
        }
        let now = to_millis(self.clock.now());
        let delay = Duration::from_millis((at - now).max(0) as u64).min(MAX_SLEEP);
        let handle = ctx.run_later(delay, |this, ctx| {
            this.scheduling.next = None;
            this.schedule_pass(ctx);
        });
        self.scheduling.next = Some((at, handle));
    }

    /// Advances schedule `row`, found due at `now`: starts its occurrence (or skips the missed
    /// ones), then executes the run it inserted, if it inserted one.
    fn advance(&mut self, row: ScheduleRow, now: i64, ctx: &mut Context<Self>) {
        if self.scheduling.advancing.contains(&row.name) {
            return;
        }
        let cron = match Cron::parse(&row.cron) {
            Ok(cron) => cron,
            Err(err) => {
                tracing::warn!(schedule = %row.name, %err, "a stored schedule cannot be read");
                return;
            }
        };
        let Some(due) = schedule::due(&cron, row.missed, row.next_at, now) else {
            return;
        };
        let name = row.name.clone();
        self.scheduling.advancing.insert(name.clone());
        let advance = AdvanceSchedule::new(row, due);
        let run_id = advance.run_id.clone();
        let applied = self.store_actor.apply(advance, Durability::Durable);
        let done = applied.into_actor(self).map(move |advanced, this, ctx| {
            this.scheduling.advancing.remove(&name);
            match advanced {
                Ok(Advanced::Started { agent }) => {
                    tracing::info!(schedule = %name, %run_id, %agent, "scheduled run started");
                    this.execute_scheduled(run_id, ctx);
                }
                Ok(Advanced::Skipped) => {
                    tracing::info!(schedule = %name, latest = %run_id, "missed occurrences skipped")
                }
                Ok(Advanced::Existed) => {
                    tracing::warn!(schedule = %name, %run_id, "a run of the occurrence's id existed already; the schedule moved on")
                }
                Ok(Advanced::Taken) => {
                    tracing::debug!(schedule = %name, %run_id, "the occurrence was another's")
                }
                Err(err) => {
                    tracing::warn!(schedule = %name, %run_id, %err, "could not advance the schedule; a later pass tries again")
                }
            }
            this.schedule_at(due.next, ctx);
        });
        ctx.spawn(done);
    }

    /// Executes a run a schedule just inserted, once a slot is free, as a run that waited for
    /// one. A failure is left to recovery, here or elsewhere: the run is a RUNNING run nobody
    /// holds.
    fn execute_scheduled(&mut self, run_id: crate::types::RunId, ctx: &mut Context<Self>) {
        let execution = self.execute(run_id.clone(), Job::Turn, ctx);
        actix_rt::spawn(async move {
            match execution.await {
                Ok(reply) => {
                    tracing::debug!(%run_id, outcome = ?reply.outcome, "scheduled run returned")
                }
                Err(err) => {
                    tracing::debug!(%run_id, %err, "scheduled run stopped; recovery takes it up")
                }
            }
        });
    }
}
