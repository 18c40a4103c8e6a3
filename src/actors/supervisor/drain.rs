//! A supervisor's drain, for a deploy: it admits nothing more, hands each run it executes over
//! at the run's next step boundary (its lease released, so that another replica continues it
//! at once, with nothing to reconcile), and gives up at a deadline.

use std::time::Duration;

use actix::{Addr, AsyncContext, Context, Handler, Message, ResponseFuture};
use tokio::sync::oneshot;

use super::Supervisor;
use crate::actors::run::DrainSignal;
use crate::{
    error::{Error, Result},
    types::{RunId, RunReply},
};

/// The deadline of [`Drain::default`]: 25 s, under the 30 s a Kubernetes pod is given by
/// default between SIGTERM and SIGKILL.
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(25);

/// The grace of [`Drain::default`]: how long past the deadline the drain waits for the calls
/// it cancelled, 2 s.
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Tells a supervisor to drain, for a deploy or a shutdown; answers with a [`DrainReport`]
/// once every run it executed was handed over or came to rest, or at the deadline plus the
/// grace, whichever comes first. Send it on SIGTERM: [`drain_on_signal`] does.
///
/// - From the moment it arrives, the supervisor admits nothing: a start, a resume, a fork, a
///   decision to resume, its recovery and its watch are refused with [`Error::Draining`],
///   writing nothing (a fork or a decision that was committing as the drain began is kept, and
///   its run left to the other replicas). Runs that waited for a slot stay in the database,
///   unleased, for the other replicas' recovery; their callers hear [`Error::HandedOver`].
/// - A run between two steps stops at its next step boundary.
/// - A tool call in flight runs to its end (or its timeout), and its outcome is recorded; then
///   the run stops. So does a call whose start was committing as the drain began.
/// - A model call in flight is abandoned at once: it has no side effect, so dropping it is
///   safe, and waiting for it would hold the drain for as long as the model takes. Its step
///   goes back to pending, the attempt not counted against the model policy, and the next
///   owner makes it again. A failed attempt whose backoff the drain cut short stays counted.
/// - Then the run's lease is released with `run.released`: another replica with
///   [`Config::recovery`](crate::Config::recovery) or [`Config::watch`](crate::Config::watch)
///   hears of it through the change feed and takes it over at once, writing `run.handed_over`.
///   Nothing was in flight: no `step.interrupted`, no `step.reconciled`, no TTL to wait out.
///   The call that executed the run ends with [`Error::HandedOver`].
/// - At the deadline, the tool calls still running get their cancellation signal (the call's
///   own: the run is not cancelled). A tool that honours it returns; what it returns is
///   recorded as its outcome, as after a timeout, and the run is handed over. What still runs
///   `grace` later is left: the drain answers, naming those runs in
///   [`DrainReport::left_running`]. If the process exits then, each of them is exactly a crash:
///   its lease expires after its TTL, and the next owner reconciles the call in flight.
///
/// A drain cannot hang: it answers by `deadline + grace` at the latest. Sent again, it answers
/// with the first one's report, when that one ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Message)]
#[rtype(result = "DrainReport")]
pub struct Drain {
    deadline: Duration,
    grace: Duration,
}

impl Default for Drain {
    /// A drain within [`DEFAULT_DRAIN_DEADLINE`], with [`DEFAULT_DRAIN_GRACE`].
    fn default() -> Self {
        Drain {
            deadline: DEFAULT_DRAIN_DEADLINE,
            grace: DEFAULT_DRAIN_GRACE,
        }
    }
}

impl Drain {
    /// A drain whose tools in flight have `deadline` to finish. Leave room under the
    /// orchestrator's grace period (Kubernetes' `terminationGracePeriodSeconds`) for the grace
    /// and the process's exit.
    pub fn within(deadline: Duration) -> Self {
        Drain {
            deadline,
            ..Drain::default()
        }
    }

    /// How long past the deadline the drain waits for the calls it cancelled.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The deadline.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }
}

/// What a drain did with the runs the supervisor executed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// The runs handed over at a step boundary: another replica continues each at once.
    pub handed_over: Vec<RunId>,
    /// The runs whose call ended otherwise during the drain: finished, paused for a person,
    /// cancelled, or stopped by an error (a lost lease, a store that failed).
    pub settled: Vec<RunId>,
    /// The runs still executing when the drain gave up, each after its cancellation signal: if
    /// the process exits now, each is a crash, taken over once its lease expires.
    pub left_running: Vec<RunId>,
    /// How many runs that waited for a slot were left in the database, for the other
    /// replicas' recovery.
    pub left_queued: usize,
}

impl DrainReport {
    /// Whether every run was handed over or came to rest: nothing is left as a crash.
    pub fn is_clean(&self) -> bool {
        self.left_running.is_empty()
    }
}

/// What a supervisor keeps of its drain.
#[derive(Default)]
pub(super) struct Draining {
    /// Fired when the drain starts, and at its deadline: every run's loop hears them.
    pub(super) signal: DrainSignal,
    report: DrainReport,
    /// The callers waiting for the report.
    waiters: Vec<oneshot::Sender<DrainReport>>,
    /// The report was given: the drain is over (the supervisor still admits nothing).
    done: bool,
}

impl Draining {
    /// Whether the supervisor drains (or drained): it admits nothing.
    pub(super) fn is_on(&self) -> bool {
        self.signal.started.is_cancelled()
    }
}

impl Handler<Drain> for Supervisor {
    type Result = ResponseFuture<DrainReport>;

    fn handle(&mut self, msg: Drain, ctx: &mut Context<Self>) -> Self::Result {
        let (answer, report) = oneshot::channel();
        if self.draining.done {
            let _ = answer.send(self.draining.report.clone());
        } else {
            self.draining.waiters.push(answer);
        }
        if !self.draining.is_on() {
            self.start_drain(msg, ctx);
        }
        Box::pin(async move { report.await.unwrap_or_default() })
    }
}

impl Supervisor {
    fn start_drain(&mut self, drain: Drain, ctx: &mut Context<Self>) {
        tracing::info!(
            executing = self.executing.len(),
            queued = self.admission.len(),
            deadline = ?drain.deadline,
            "supervisor draining: its runs are handed over at their next step boundary"
        );
        self.draining.signal.started.cancel();
        // The runs waiting for a slot are in the database with no lease: another replica's
        // recovery takes them.
        for (run_id, reply) in self.admission.leave() {
            let _ = reply.send(Err(Error::HandedOver { run_id }));
            self.draining.report.left_queued += 1;
        }
        ctx.run_later(drain.deadline, move |this, ctx| {
            if this.draining.done || this.executing.is_empty() {
                return;
            }
            tracing::warn!(
                executing = this.executing.len(),
                grace = ?drain.grace,
                "drain deadline passed: the calls still running are cancelled"
            );
            this.draining.signal.cut.cancel();
            ctx.run_later(drain.grace, |this, _| this.finish_drain());
        });
        self.finish_drain_if_idle();
    }

    /// A call that executed `run_id` returned during a drain.
    pub(super) fn drained_execution_ended(&mut self, run_id: &RunId, result: &Result<RunReply>) {
        if !self.draining.is_on() || self.draining.done {
            return;
        }
        let report = &mut self.draining.report;
        match result {
            Err(Error::HandedOver { .. }) => report.handed_over.push(run_id.clone()),
            // Refused before it executed anything: nothing of it came to rest here.
            Err(
                Error::UnknownAgent(_)
                | Error::RunExists(_)
                | Error::RunLeased { .. }
                | Error::RunState { .. }
                | Error::RunNotFound(_)
                | Error::Draining,
            ) => {}
            _ => report.settled.push(run_id.clone()),
        }
        self.finish_drain_if_idle();
    }

    /// A run inserted to wait for a slot as the drain began: left in the database.
    pub(super) fn drain_left_queued(&mut self) {
        if !self.draining.done {
            self.draining.report.left_queued += 1;
        }
    }

    fn finish_drain_if_idle(&mut self) {
        if self.executing.is_empty() {
            self.finish_drain();
        }
    }

    /// Answers the drain: whatever still executes is left running.
    fn finish_drain(&mut self) {
        if self.draining.done {
            return;
        }
        self.draining.done = true;
        let report = &mut self.draining.report;
        report.left_running = self.executing.keys().cloned().collect();
        report.left_running.sort();
        tracing::info!(
            handed_over = report.handed_over.len(),
            settled = report.settled.len(),
            left_running = report.left_running.len(),
            left_queued = report.left_queued,
            "supervisor drained"
        );
        for waiter in self.draining.waiters.drain(..) {
            let _ = waiter.send(report.clone());
        }
    }

    /// Refuses what would execute a run, or write to start one, once draining.
    pub(super) fn refuse_if_draining(&self) -> Result<()> {
        if self.draining.is_on() {
            return Err(Error::Draining);
        }
        Ok(())
    }
}

/// Whether the supervisor drains (or drained): it admits nothing. For the API's routes that
/// answer before the run executes.
#[derive(Message)]
#[rtype(result = "bool")]
pub(crate) struct IsDraining;

impl Handler<IsDraining> for Supervisor {
    type Result = bool;

    fn handle(&mut self, _: IsDraining, _: &mut Context<Self>) -> bool {
        self.draining.is_on()
    }
}

/// Waits for SIGTERM or SIGINT (Ctrl-C), then drains `supervisor` as `drain` says, and
/// answers with its report. The handlers are installed by the call itself, not when the
/// future is first polled: a signal that comes right after is caught. Call it inside the
/// running actix system, as early as the supervisor exists. A second signal during the drain
/// is ignored: the orchestrator's SIGKILL is what ends a drain early.
///
/// Spawn it beside the application's work, and stop the system once it answers; in an
/// actix-web service, disable the server's own signal handling and stop the server after it:
///
/// ```no_run
/// # use agentrt::{Drain, Supervisor};
/// # async fn demo(supervisor: actix::Addr<Supervisor>, server: actix_web::dev::ServerHandle) {
/// // HttpServer::new(..).disable_signals() ... .run(), whose handle is `server`:
/// actix_rt::spawn(async move {
///     agentrt::drain_on_signal(supervisor, Drain::default()).await;
///     server.stop(true).await;
/// });
/// # }
/// ```
pub fn drain_on_signal(
    supervisor: Addr<Supervisor>,
    drain: Drain,
) -> impl std::future::Future<Output = DrainReport> {
    // Installed now, not at the first poll: a signal right after this call drains.
    let signals = Signals::install();
    async move {
        signals.wait().await;
        // A supervisor that stopped already has nothing left to drain.
        supervisor.send(drain).await.unwrap_or_default()
    }
}

/// On SIGTERM or SIGINT, drains `supervisor` (see [`drain_on_signal`]), then stops the
/// current actix system: for an application that runs its system with `System::run()` (or an
/// actix-web server's, which ends with it). Call it inside the running system, as early as the
/// supervisor exists. Under `#[actix::main]`, whose `main` future the system's stop does not
/// end, await [`drain_on_signal`] at the end of `main` instead.
///
/// ```no_run
/// # use agentrt::{Drain, Supervisor};
/// # fn demo(supervisor: actix::Addr<Supervisor>) {
/// agentrt::stop_on_signal(supervisor.clone(), Drain::default());
/// # }
/// ```
pub fn stop_on_signal(supervisor: Addr<Supervisor>, drain: Drain) {
    let system = actix_rt::System::current();
    let drained = drain_on_signal(supervisor, drain);
    actix_rt::spawn(async move {
        drained.await;
        system.stop();
    });
}

/// The handlers of SIGTERM and SIGINT, installed: from then on, either signal is caught
/// rather than ending the process.
pub(crate) struct Signals {
    #[cfg(unix)]
    term: Option<actix_rt::signal::unix::Signal>,
    #[cfg(unix)]
    interrupt: Option<actix_rt::signal::unix::Signal>,
}

impl Signals {
    /// Installs both handlers. One that cannot be installed is logged, and only the other is
    /// waited for (a failure to install both is logged twice: nothing then ends the wait).
    /// Must be called inside a running actix system.
    pub(crate) fn install() -> Self {
        #[cfg(unix)]
        {
            use actix_rt::signal::unix::{SignalKind, signal};
            let install = |kind: SignalKind, name: &str| match signal(kind) {
                Ok(signal) => Some(signal),
                Err(err) => {
                    tracing::error!(%err, "could not listen for {name}");
                    None
                }
            };
            Signals {
                term: install(SignalKind::terminate(), "SIGTERM"),
                interrupt: install(SignalKind::interrupt(), "SIGINT"),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    /// Completes at the first of the signals.
    pub(crate) async fn wait(self) {
        #[cfg(unix)]
        {
            async fn first(signal: Option<actix_rt::signal::unix::Signal>) {
                match signal {
                    Some(mut signal) => {
                        signal.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            let (term, interrupt) = (first(self.term), first(self.interrupt));
            futures_util::pin_mut!(term, interrupt);
            futures_util::future::select(term, interrupt).await;
        }
        #[cfg(not(unix))]
        if let Err(err) = actix_rt::signal::ctrl_c().await {
            tracing::error!(%err, "could not listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("signal received: draining");
    }
}
