//! The JSON shape of every public data type: pinned byte for byte, and read back to the same
//! value. A change here breaks stored logs, the CLI's `--json` output and API clients.

use std::time::{Duration, SystemTime};

use agentrt::{
    Approval, ApprovalReason, ChatMessage, Event, EventKind, FencingToken, Lease, LeaseLostReason,
    ModelResponse, Outcome, PendingCall, Run, RunId, RunReply, RunState, ToolCall, ToolResult,
    ToolSpec, Usage,
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::json;

/// Serializes `value` to exactly `expected`, and reads `expected` back to `value`.
#[track_caller]
fn pins<T>(value: &T, expected: &str)
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    assert_eq!(serde_json::to_string(value).unwrap(), expected);
    assert_eq!(&serde_json::from_str::<T>(expected).unwrap(), value);
}

fn at(millis: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(millis)
}

fn pending() -> PendingCall {
    PendingCall {
        step: 2,
        call_id: "pay-1".into(),
        tool: "pay".into(),
        args: json!({"cents": 100}),
        reason: ApprovalReason::Policy,
    }
}

#[test]
fn a_run_id_is_its_string() {
    pins(&RunId::from("order-17"), r#""order-17""#);
}

#[test]
fn a_run_state_is_the_name_it_is_stored_under() {
    for state in [
        RunState::Running,
        RunState::WaitingForApproval,
        RunState::Succeeded,
        RunState::Failed,
        RunState::Cancelled,
    ] {
        pins(&state, &format!("\"{}\"", state.as_str()));
    }
    pins(&RunState::WaitingForApproval, r#""WAITING_FOR_APPROVAL""#);
}

#[test]
fn an_event_kind_is_the_name_in_the_log() {
    for kind in EventKind::ALL {
        pins(&kind, &format!("\"{}\"", kind.as_str()));
    }
    pins(&EventKind::RunStarted, r#""run.started""#);
    pins(&EventKind::ToolFinished, r#""step.tool_finished""#);
}

#[test]
fn a_run_has_snake_case_fields_and_times_in_milliseconds_since_the_epoch() {
    let run = Run {
        id: "order-17".into(),
        agent: "support".into(),
        input: json!({"customer": "ada"}),
        state: RunState::Succeeded,
        output: Some("done".into()),
        error: None,
        created_at: at(1_700_000_000_000),
        updated_at: at(1_700_000_000_250),
    };
    pins(
        &run,
        r#"{"id":"order-17","agent":"support","input":{"customer":"ada"},"state":"SUCCEEDED","output":"done","error":null,"created_at":1700000000000,"updated_at":1700000000250}"#,
    );
}

#[test]
fn a_time_before_the_epoch_is_negative() {
    let lease = Lease {
        owner: "w".into(),
        expires_at: SystemTime::UNIX_EPOCH - Duration::from_millis(1_500),
        fencing_token: FencingToken::new(1),
    };
    pins(
        &lease,
        r#"{"owner":"w","expires_at":-1500,"fencing_token":1}"#,
    );
}

#[test]
fn an_event_carries_its_kind_time_step_and_payload() {
    let event = Event {
        run_id: "order-17".into(),
        seq: 3,
        kind: EventKind::ModelFinished,
        at: at(1_700_000_000_100),
        step: Some(1),
        payload: json!({"text": "hi", "tool_calls": []}),
    };
    pins(
        &event,
        r#"{"run_id":"order-17","seq":3,"kind":"step.model_finished","at":1700000000100,"step":1,"payload":{"text":"hi","tool_calls":[]}}"#,
    );
    let run_level = Event {
        step: None,
        kind: EventKind::RunStarted,
        ..event
    };
    pins(
        &run_level,
        r#"{"run_id":"order-17","seq":3,"kind":"run.started","at":1700000000100,"step":null,"payload":{"text":"hi","tool_calls":[]}}"#,
    );
}

#[test]
fn a_lease_names_its_owner_and_expiry() {
    let lease = Lease {
        owner: "worker-1/3f2a".into(),
        expires_at: at(1_700_000_030_000),
        fencing_token: FencingToken::new(2),
    };
    pins(
        &lease,
        r#"{"owner":"worker-1/3f2a","expires_at":1700000030000,"fencing_token":2}"#,
    );
    // A lease written before tokens existed reads as token 0.
    let old: Lease =
        serde_json::from_str(r#"{"owner":"worker-1/3f2a","expires_at":1700000030000}"#).unwrap();
    assert_eq!(old.fencing_token, FencingToken::new(0));
}

#[test]
fn a_pending_call_names_its_step_call_tool_args_and_reason() {
    pins(
        &pending(),
        r#"{"step":2,"call_id":"pay-1","tool":"pay","args":{"cents":100},"reason":"policy"}"#,
    );
    pins(&ApprovalReason::Reconcile, r#""reconcile""#);
}

#[test]
fn an_outcome_is_tagged_by_status() {
    pins(
        &Outcome::Succeeded {
            output: "done".into(),
        },
        r#"{"status":"succeeded","output":"done"}"#,
    );
    pins(
        &Outcome::Failed {
            error: "boom".into(),
        },
        r#"{"status":"failed","error":"boom"}"#,
    );
    pins(
        &Outcome::Cancelled {
            reason: "duplicate order".into(),
        },
        r#"{"status":"cancelled","reason":"duplicate order"}"#,
    );
    pins(
        &RunReply {
            run_id: "order-17".into(),
            outcome: Outcome::WaitingForApproval { pending: pending() },
        },
        r#"{"run_id":"order-17","outcome":{"status":"waiting_for_approval","pending":{"step":2,"call_id":"pay-1","tool":"pay","args":{"cents":100},"reason":"policy"}}}"#,
    );
}

#[test]
fn an_approval_names_the_call_the_decision_and_who_made_it() {
    pins(
        &Approval::approve("order-17", "pay-1", "alice").note("checked"),
        r#"{"run_id":"order-17","call_id":"pay-1","approved":true,"by":"alice","note":"checked"}"#,
    );
    pins(
        &Approval::deny("order-17", "pay-1", "bob"),
        r#"{"run_id":"order-17","call_id":"pay-1","approved":false,"by":"bob","note":null}"#,
    );
    // A note may be left out.
    let read: Approval = serde_json::from_str(
        r#"{"run_id":"order-17","call_id":"pay-1","approved":false,"by":"bob"}"#,
    )
    .unwrap();
    assert_eq!(read, Approval::deny("order-17", "pay-1", "bob"));
}

#[test]
fn a_lease_lost_reason_is_tagged_by_kind() {
    pins(
        &LeaseLostReason::TakenBy("worker-2/9c1e".into()),
        r#"{"kind":"taken_by","by":"worker-2/9c1e"}"#,
    );
    pins(
        &LeaseLostReason::ReleasedOrCancelled,
        r#"{"kind":"released_or_cancelled"}"#,
    );
    pins(&LeaseLostReason::Expired, r#"{"kind":"expired"}"#);
}

#[test]
fn model_responses_tool_results_and_messages_keep_the_shape_they_are_logged_in() {
    let response = ModelResponse {
        text: Some("Let me look.".into()),
        tool_calls: vec![ToolCall::new("c1", "weather", json!({"city": "Oslo"}))],
        ..ModelResponse::default()
    };
    pins(
        &response,
        r#"{"text":"Let me look.","tool_calls":[{"id":"c1","name":"weather","args":{"city":"Oslo"}}]}"#,
    );
    pins(&ModelResponse::calls(vec![]), r#"{"tool_calls":[]}"#);
    let paid = ModelResponse {
        usage: Some(Usage::new(412, 18)),
        model: Some("m-1".into()),
        ..ModelResponse::answer("hi")
    };
    pins(
        &paid,
        r#"{"text":"hi","tool_calls":[],"usage":{"input_tokens":412,"output_tokens":18},"model":"m-1"}"#,
    );
    pins(
        &ChatMessage::System {
            text: "Be brief.".into(),
        },
        r#"{"role":"system","text":"Be brief."}"#,
    );
    pins(
        &ChatMessage::User {
            text: "Where is my order?".into(),
        },
        r#"{"role":"user","text":"Where is my order?"}"#,
    );
    pins(
        &ToolSpec::new(
            "weather",
            "The weather in a city.",
            json!({"type": "object"}),
        ),
        r#"{"name":"weather","description":"The weather in a city.","parameters":{"type":"object"}}"#,
    );
    pins(
        &ToolResult::Ok(json!({"sky": "clear"})),
        r#"{"ok":{"sky":"clear"}}"#,
    );
    pins(
        &ToolResult::Error("no such city".into()),
        r#"{"error":"no such city"}"#,
    );
    pins(
        &ChatMessage::Assistant(response),
        r#"{"role":"assistant","text":"Let me look.","tool_calls":[{"id":"c1","name":"weather","args":{"city":"Oslo"}}]}"#,
    );
    pins(
        &ChatMessage::Tool {
            call_id: "c1".into(),
            name: "weather".into(),
            result: ToolResult::Ok(json!({"sky": "clear"})),
        },
        r#"{"role":"tool","call_id":"c1","name":"weather","result":{"ok":{"sky":"clear"}}}"#,
    );
}

#[test]
fn json_of_the_wrong_shape_is_refused_naming_what_was_expected() {
    let kind = serde_json::from_str::<EventKind>(r#""run.exploded""#).unwrap_err();
    assert!(
        kind.to_string()
            .contains("unknown event kind \"run.exploded\""),
        "{kind}"
    );
    let state = serde_json::from_str::<RunState>(r#""running""#).unwrap_err();
    assert!(state.to_string().contains("RUNNING"), "{state}");
    let time =
        serde_json::from_str::<Lease>(r#"{"owner":"w","expires_at":"2023-11-14T22:13:20Z"}"#)
            .unwrap_err();
    assert!(
        time.to_string()
            .contains("integer milliseconds since the Unix epoch"),
        "{time}"
    );
    let fraction = serde_json::from_str::<Lease>(r#"{"owner":"w","expires_at":1.5}"#).unwrap_err();
    assert!(fraction.to_string().contains("milliseconds"), "{fraction}");
}

#[test]
fn move_infos_and_the_synchronous_setting_have_their_documented_shape() {
    let info = agentrt::MoveInfo {
        kind: agentrt::MoveKind::DecideTool,
        run_id: agentrt::RunId::from("r1"),
    };
    let json = serde_json::to_value(&info).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"kind": "decide_tool", "run_id": "r1"})
    );
    assert_eq!(
        serde_json::from_value::<agentrt::MoveInfo>(json).unwrap(),
        info
    );
    for kind in [agentrt::MoveKind::CreateRun, agentrt::MoveKind::TakeOver] {
        assert_eq!(serde_json::to_value(kind).unwrap(), kind.as_str());
    }
    let full = agentrt::sqlite::Synchronous::Full;
    assert_eq!(serde_json::to_value(full).unwrap(), full.as_str());
}
