//! The cases of waits: a call that waits for an answer, an event, a time or a child run, what
//! wakes it, and the resume that goes on with what came.

use serde_json::{Value, json};

use super::{
    Moves, OTHER, allow, call, create, holder, kinds, last_payload, me, model_answered_by, on, run,
};
use crate::{
    Answer, Delivered, Delivery, Error, EventKind, RunId, RunState, ToolResult, WaitKind,
    clock::to_millis,
    store::{
        Store,
        model::{Grant, ModelOutcome, Rendered},
        moves::{self, Began, Resumed, WaitRequest},
    },
    types::{ModelResponse, StepState, ToolCall},
};

impl Moves<'_> {
    pub(crate) fn begin_wait(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: &ToolCall,
        request: WaitRequest,
    ) -> crate::Result<Began> {
        self.apply(moves::BeginWait {
            by: self.by(grant),
            step,
            attempt,
            call: call.clone(),
            request,
        })
    }

    pub(crate) fn resume_wait(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: &ToolCall,
    ) -> crate::Result<Resumed> {
        self.apply(moves::ResumeWait {
            by: self.by(grant),
            step,
            attempt,
            call: call.clone(),
        })
        .map(|(_, resumed)| resumed)
    }
}

fn now() -> i64 {
    to_millis(std::time::SystemTime::now())
}

/// Run `run_id` under `grant` with call `c1` (step 2) in flight at attempt 1.
fn in_flight(store: &Store, run_id: &RunId, grant: &Grant) {
    create(store, run_id, grant);
    model_answered_by(store, run_id, grant, vec![call("c1")]);
    on(store, run_id, |m| {
        m.decide_tool(grant, 2, &call("c1"), &allow())
    })
    .unwrap();
}

fn question() -> WaitRequest {
    WaitRequest::Answer {
        question: "Which account?".into(),
        schema: Some(json!({"type": "string", "enum": ["savings", "checking"]})),
    }
}

fn answer(run_id: &RunId, value: Value) -> Answer {
    Answer {
        run_id: run_id.clone(),
        call_id: "c1".into(),
        answer: value,
        by: "alice".into(),
    }
}

pub(crate) fn a_wait_releases_the_lease_and_is_refused_under_a_lost_lease(f: &dyn super::Fixture) {
    let store = f.store();
    let r = run("r");
    in_flight(&store, &r, &me());
    let theirs = holder(OTHER, std::time::Duration::from_secs(30));
    let err = on(&store, &r, |m| {
        m.begin_wait(&theirs, 2, 1, &call("c1"), question())
    })
    .unwrap_err();
    assert!(
        matches!(err, Error::RunLeased { .. } | Error::LeaseLost { .. }),
        "{err}"
    );
    assert_eq!(store.run(&r).unwrap().state, RunState::Running);

    let began = on(&store, &r, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), question())
    })
    .unwrap();
    let Began::Waiting(wait) = began else {
        panic!("{began:?}")
    };
    assert_eq!(
        (wait.kind, wait.step, wait.key.as_str()),
        (WaitKind::Answer, 2, "c1")
    );
    assert_eq!(store.run(&r).unwrap().state, RunState::WaitingForAnswer);
    assert!(store.lease(&r).unwrap().is_none(), "released with the wait");
    assert_eq!(store.wait(&r).unwrap(), Some(wait));
    let waiting = last_payload(&store, &r);
    assert_eq!(waiting["waits_for"], "answer");
    assert_eq!(waiting["detail"]["question"], "Which account?");
    // The loop that made it wait writes nothing more.
    let err = on(&store, &r, |m| {
        let ok = ToolResult::Ok(json!(1));
        m.finish_tool(&me(), 2, 1, "c1", &ok)
    })
    .unwrap_err();
    assert!(
        err.is_run_state() || matches!(err, Error::LeaseLost { .. }),
        "{err}"
    );
}

pub(crate) fn an_answer_wakes_its_wait_once_and_one_resume_goes_on_with_it(f: &dyn super::Fixture) {
    let store = f.store();
    let r = run("r");
    in_flight(&store, &r, &me());
    on(&store, &r, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), question())
    })
    .unwrap();
    let events = store.events(&r).unwrap().len();
    // Not answered: a resume is refused and writes nothing.
    let err = on(&store, &r, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    let err = store.answer(&answer(&r, json!("gold"))).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert_eq!(
        store.events(&r).unwrap().len(),
        events,
        "refusals write nothing"
    );

    store.answer(&answer(&r, json!("savings"))).unwrap();
    assert!(
        store
            .answer(&answer(&r, json!("checking")))
            .unwrap_err()
            .is_run_state()
    );
    assert_eq!(kinds(&store, &r).last(), Some(&EventKind::WaitWoken));
    assert_eq!(store.run(&r).unwrap().state, RunState::WaitingForAnswer);

    let resumed = on(&store, &r, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    assert_eq!(resumed, Resumed::Finished(ToolResult::Ok(json!("savings"))));
    assert_eq!(store.run(&r).unwrap().state, RunState::Running);
    assert_eq!(store.lease(&r).unwrap().unwrap().owner, super::OWNER);
    assert_eq!(store.wait(&r).unwrap(), None);
    let steps = store.read(|reads| reads.steps(&r)).unwrap();
    assert_eq!(steps[1].state, StepState::Finished);
    assert_eq!(steps[1].result, Some(json!({"ok": "savings"})));
    let tail: Vec<EventKind> = kinds(&store, &r).into_iter().rev().take(2).collect();
    assert_eq!(tail, [EventKind::ToolFinished, EventKind::RunResumed]);
    // Of two resumers one wins.
    let err = on(&store, &r, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap_err();
    assert!(
        err.is_run_state() || matches!(err, Error::RunLeased { .. }),
        "{err}"
    );
}

pub(crate) fn an_event_is_kept_until_its_wait_and_a_repeat_is_a_duplicate(f: &dyn super::Fixture) {
    let store = f.store();
    let r = run("r");
    in_flight(&store, &r, &me());
    let delivery = |id: &str| Delivery {
        run_id: r.clone(),
        name: "paid".into(),
        event_id: id.into(),
        payload: json!({ "id": id }),
    };
    assert_eq!(
        store.deliver_event(&delivery("e1")).unwrap(),
        Delivered::Kept
    );
    assert_eq!(
        store.deliver_event(&delivery("e1")).unwrap(),
        Delivered::Duplicate
    );
    assert_eq!(
        store.deliver_event(&delivery("e2")).unwrap(),
        Delivered::Kept
    );
    // The first kept event is taken at once: no wait.
    let event = WaitRequest::Event {
        name: "paid".into(),
    };
    let began = on(&store, &r, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), event)
    })
    .unwrap();
    assert_eq!(began, Began::Finished(ToolResult::Ok(json!({"id": "e1"}))));
    assert_eq!(store.run(&r).unwrap().state, RunState::Running);
    assert_eq!(last_payload(&store, &r)["event_id"], "e1");

    // A wait on a name nothing was kept for waits, and the next delivery wakes it.
    let s = run("s");
    in_flight(&store, &s, &me());
    let event = WaitRequest::Event {
        name: "shipped".into(),
    };
    on(&store, &s, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), event)
    })
    .unwrap();
    assert_eq!(store.run(&s).unwrap().state, RunState::WaitingForEvent);
    let shipped = Delivery {
        run_id: s.clone(),
        name: "shipped".into(),
        event_id: "e9".into(),
        payload: json!(9),
    };
    assert_eq!(store.deliver_event(&shipped).unwrap(), Delivered::Woke);
    assert_eq!(store.deliver_event(&shipped).unwrap(), Delivered::Duplicate);
    let resumed = on(&store, &s, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    assert_eq!(resumed, Resumed::Finished(ToolResult::Ok(json!(9))));

    let unknown = Delivery {
        run_id: run("nobody"),
        ..shipped.clone()
    };
    assert!(matches!(
        store.deliver_event(&unknown),
        Err(Error::RunNotFound(_))
    ));
    let unnamed = Delivery {
        name: " ".into(),
        ..shipped.clone()
    };
    assert!(matches!(
        store.deliver_event(&unnamed),
        Err(Error::InvalidInput(_))
    ));
    store.cancel(&s, "done").unwrap();
    // A sender's retry of what it delivered is told it was kept, whatever came since.
    assert_eq!(store.deliver_event(&shipped).unwrap(), Delivered::Duplicate);
    let finished = Delivery {
        event_id: "e10".into(),
        ..shipped
    };
    assert!(store.deliver_event(&finished).unwrap_err().is_run_state());
    // Refused again, not a duplicate: the refused delivery was not kept.
    assert!(store.deliver_event(&finished).unwrap_err().is_run_state());
}

pub(crate) fn a_timer_is_ready_at_its_time_through_the_index_of_ready_waits(
    f: &dyn super::Fixture,
) {
    let store = f.store();
    let r = run("r");
    in_flight(&store, &r, &me());
    let at = now() + 3_600_000;
    let timer = WaitRequest::Timer {
        at,
        reason: "tomorrow".into(),
        retry: false,
    };
    on(&store, &r, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), timer)
    })
    .unwrap();
    assert_eq!(store.run(&r).unwrap().state, RunState::WaitingForTimer);
    let err = on(&store, &r, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    let (due_now, due_later, next) = store
        .read(|reads| {
            Ok((
                reads.ready_waits(now(), &["agent"], None, 10)?,
                reads.ready_waits(at, &["agent", "other"], None, 10)?,
                reads.next_ready_at(now(), &["agent"])?,
            ))
        })
        .unwrap();
    assert!(due_now.is_empty());
    assert_eq!(due_later, [(r.clone(), at)]);
    assert_eq!(next, Some(at));
    let other_agent = store
        .read(|reads| reads.ready_waits(at, &["other"], None, 10))
        .unwrap();
    assert!(other_agent.is_empty(), "read per agent");

    // A time already past ends the call at once.
    let s = run("s");
    in_flight(&store, &s, &me());
    let past = WaitRequest::Timer {
        at: now() - 1,
        reason: "now".into(),
        retry: false,
    };
    let began = on(&store, &s, |m| m.begin_wait(&me(), 2, 1, &call("c1"), past)).unwrap();
    assert!(
        matches!(began, Began::Finished(ToolResult::Ok(_))),
        "{began:?}"
    );

    // A tool's own timer makes the call again, as its next attempt, once due.
    let t = run("t");
    in_flight(&store, &t, &me());
    let again = WaitRequest::Timer {
        at: now() - 1,
        reason: "not ready".into(),
        retry: true,
    };
    on(&store, &t, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), again)
    })
    .unwrap();
    assert_eq!(store.run(&t).unwrap().state, RunState::WaitingForTimer);
    let resumed = on(&store, &t, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    assert_eq!(resumed, Resumed::Again);
    let steps = store.read(|reads| reads.steps(&t)).unwrap();
    assert_eq!((steps[1].state, steps[1].attempt), (StepState::InFlight, 2));
    assert_eq!(kinds(&store, &t).last(), Some(&EventKind::ToolStarted));
}

/// A child run's answer (or failure) as its loop records it under `grant`.
fn child_ends(store: &Store, child: &RunId, grant: &Grant, answer: Option<&str>) {
    on(store, child, |m| m.take_over(grant)).unwrap();
    on(store, child, |m| m.begin_model_step(grant, 1)).unwrap();
    let outcome = match answer {
        Some(text) => {
            let response = ModelResponse::answer(text);
            ModelOutcome::Answered {
                recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
                response,
            }
        }
        None => ModelOutcome::Failed {
            error: "no luck".into(),
            attempts: 1,
        },
    };
    on(store, child, |m| m.finish_model_step(grant, 1, 1, &outcome)).unwrap();
}

fn delegate(max_depth: u32) -> WaitRequest {
    WaitRequest::Child {
        agent: "researcher".into(),
        input: json!("find it"),
        max_depth,
    }
}

pub(crate) fn a_child_is_inserted_with_its_parents_wait_and_its_end_wakes_the_parent(
    f: &dyn super::Fixture,
) {
    let store = f.store();
    let p = run("p");
    in_flight(&store, &p, &me());
    let began = on(&store, &p, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(3))
    })
    .unwrap();
    let Began::Waiting(wait) = began else {
        panic!("{began:?}")
    };
    let child = RunId::from("p/2");
    assert_eq!(wait.key, child.as_str());
    assert_eq!(store.run(&p).unwrap().state, RunState::WaitingForChild);
    let row = store.run(&child).unwrap();
    assert_eq!(
        (row.state, row.agent.as_str()),
        (RunState::Running, "researcher")
    );
    assert_eq!(row.input, json!("find it"));
    assert!(
        store.lease(&child).unwrap().is_none(),
        "nobody holds a new child"
    );
    let started = &store.events(&child).unwrap()[0];
    assert_eq!(started.payload["parent"]["run_id"], "p");
    assert_eq!(started.payload["parent"]["step"], 2);

    // The child's answer wakes the parent, whose call ends with it.
    child_ends(&store, &child, &me(), Some("found"));
    assert_eq!(store.run(&child).unwrap().state, RunState::Succeeded);
    assert_eq!(kinds(&store, &p).last(), Some(&EventKind::WaitWoken));
    assert_eq!(last_payload(&store, &p)["child"], "p/2");
    let resumed = on(&store, &p, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    assert_eq!(resumed, Resumed::Finished(ToolResult::Ok(json!("found"))));

    // A failed child is the parent's call's error; a depth past the limit is refused.
    let q = run("q");
    in_flight(&store, &q, &me());
    on(&store, &q, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(3))
    })
    .unwrap();
    let child = RunId::from("q/2");
    child_ends(&store, &child, &me(), None);
    let resumed = on(&store, &q, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    let Resumed::Finished(ToolResult::Error(error)) = resumed else {
        panic!("{resumed:?}")
    };
    assert!(
        error.contains("q/2") && error.contains("no luck"),
        "{error}"
    );

    let d = run("d");
    in_flight(&store, &d, &me());
    on(&store, &d, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(1))
    })
    .unwrap();
    let grandchild_parent = RunId::from("d/2");
    on(&store, &grandchild_parent, |m| m.take_over(&me())).unwrap();
    model_answered_by(&store, &grandchild_parent, &me(), vec![call("c1")]);
    on(&store, &grandchild_parent, |m| {
        m.decide_tool(&me(), 2, &call("c1"), &allow())
    })
    .unwrap();
    let began = on(&store, &grandchild_parent, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(1))
    })
    .unwrap();
    let Began::Finished(ToolResult::Error(error)) = began else {
        panic!("{began:?}")
    };
    assert!(error.contains("1 deep"), "{error}");
    assert!(store.run(&RunId::from("d/2/2")).is_err(), "no grandchild");
}

pub(crate) fn cancelling_a_parent_cancels_the_child_it_waits_for(f: &dyn super::Fixture) {
    let store = f.store();
    let p = run("p");
    in_flight(&store, &p, &me());
    on(&store, &p, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(3))
    })
    .unwrap();
    let child = RunId::from("p/2");
    store.cancel(&p, "no longer needed").unwrap();
    assert_eq!(store.run(&p).unwrap().state, RunState::Cancelled);
    assert_eq!(store.wait(&p).unwrap(), None);
    let row = store.run(&child).unwrap();
    assert_eq!(row.state, RunState::Cancelled);
    assert!(row.error.unwrap().contains("no longer needed"));
    // A child cancelled alone wakes its parent with the cancel as the call's error.
    let q = run("q");
    in_flight(&store, &q, &me());
    on(&store, &q, |m| {
        m.begin_wait(&me(), 2, 1, &call("c1"), delegate(3))
    })
    .unwrap();
    store.cancel(&RunId::from("q/2"), "stuck").unwrap();
    assert_eq!(store.run(&q).unwrap().state, RunState::WaitingForChild);
    let resumed = on(&store, &q, |m| m.resume_wait(&me(), 2, 1, &call("c1"))).unwrap();
    let Resumed::Finished(ToolResult::Error(error)) = resumed else {
        panic!("{resumed:?}")
    };
    assert!(
        error.contains("cancelled") && error.contains("stuck"),
        "{error}"
    );
}
