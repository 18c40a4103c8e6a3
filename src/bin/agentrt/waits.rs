//! The commands of waiting runs: `answer` a run's question, `signal` an event to a run, list
//! the `waits`, and what `show` says of a run's wait.

use std::{io::Read, path::Path};

use agentrt::{Answer, Delivered, Delivery, RunId, Store, Wait, WaitKind};
use clap::{ValueEnum, builder::TypedValueParser as _};
use serde::Serialize;
use serde_json::Value;

use super::{Failure, Outcome, done, not_blank, open_for_writing, print_json, table, time};

/// Who answered, when `--by` does not say: the name the web API records for a caller on
/// this machine without a token.
const ANSWERED_LOCALLY: &str = agentrt::web::LOCAL_OPERATOR;

#[derive(clap::Args)]
pub(super) struct AnswerArgs {
    run: String,
    /// The question's call id, as `show RUN` or `waits` lists it.
    call: String,
    /// The answer: JSON (`'{"account": "savings"}'`, `42`, `true`, `'"42"'`), or plain text
    /// (`yes, go ahead`), taken as a JSON string when it is not JSON and does not start with
    /// `{`, `[` or `"` (JSON mistyped is refused); `-` reads it from stdin.
    answer: String,
    /// Who answers.
    #[arg(long, value_parser = not_blank, default_value = ANSWERED_LOCALLY)]
    by: String,
}

#[derive(clap::Args)]
pub(super) struct SignalArgs {
    run: String,
    /// The event's name, which the run's `wait_for_event` names.
    #[arg(value_parser = not_blank)]
    name: String,
    /// The sender's id for the event: a second signal with the same id is a duplicate, and
    /// writes nothing.
    #[arg(long = "id", value_name = "EVENT_ID", value_parser = not_blank)]
    event_id: String,
    /// What the event carries, as JSON (the waiting call's result); `-` reads it from stdin.
    #[arg(long, value_name = "JSON")]
    payload: Option<String>,
}

#[derive(clap::Args)]
pub(super) struct WaitsArgs {
    /// Only the runs that wait for this.
    #[arg(long, value_enum)]
    kind: Option<Kind>,
    /// Waits listed, at most 1000.
    #[arg(long, default_value_t = agentrt::DEFAULT_PAGE_LIMIT,
          value_parser = clap::value_parser!(u16).range(1..=agentrt::MAX_PAGE_LIMIT as i64)
              .map(usize::from))]
    limit: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum Kind {
    Answer,
    Event,
    Timer,
    Child,
}

impl From<Kind> for WaitKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Answer => WaitKind::Answer,
            Kind::Event => WaitKind::Event,
            Kind::Timer => WaitKind::Timer,
            Kind::Child => WaitKind::Child,
        }
    }
}

/// `agentrt answer`: every refusal (the answer off the question's schema, a call that does
/// not wait for an answer) comes from the store, which writes nothing then.
pub(super) fn answer(path: &Path, args: AnswerArgs, json: bool) -> Outcome {
    let text = argument_or_stdin(&args.answer)?;
    let answer = Answer {
        run_id: RunId::from(args.run),
        call_id: args.call,
        answer: answer_value(&text)?,
        by: args.by,
    };
    let store = open_for_writing(path)?;
    store
        .answer(&answer)
        .map_err(|e| super::write_failed(path, e))?;
    done(
        json,
        &format!(
            "call {} of run {} answered by {}; a supervisor of its agent that watches the \
             database resumes it",
            answer.call_id, answer.run_id, answer.by
        ),
        &answer,
    )
}

/// `agentrt signal`: prints what came of the delivery, `woke`, `kept` or `duplicate`.
pub(super) fn signal(path: &Path, args: SignalArgs, json: bool) -> Outcome {
    let payload = match &args.payload {
        None => Value::Null,
        Some(payload) => {
            let text = argument_or_stdin(payload)?;
            serde_json::from_str(&text).map_err(|e| {
                format!(
                    "--payload is not JSON ({e}); quote text as a JSON string; nothing was written"
                )
            })?
        }
    };
    let delivery = Delivery {
        run_id: RunId::from(args.run),
        name: args.name,
        event_id: args.event_id,
        payload,
    };
    let store = open_for_writing(path)?;
    let delivered = store
        .deliver_event(&delivery)
        .map_err(|e| super::write_failed(path, e))?;
    let word = match delivered {
        Delivered::Woke => "woke",
        Delivered::Kept => "kept",
        Delivered::Duplicate => "duplicate",
    };
    done(
        json,
        word,
        &Signalled {
            run_id: &delivery.run_id,
            name: &delivery.name,
            event_id: &delivery.event_id,
            delivered,
        },
    )
}

/// `signal --json`.
#[derive(Serialize)]
struct Signalled<'a> {
    run_id: &'a RunId,
    name: &'a str,
    event_id: &'a str,
    delivered: Delivered,
}

/// `waits --json`: the waits, and whether more follow than the limit let through.
#[derive(Serialize)]
struct Listed<'a> {
    waits: &'a [Wait],
    more: bool,
}

/// `agentrt waits`: the waiting runs, longest waiting first.
pub(super) fn waits(store: &Store, args: WaitsArgs, json: bool) -> Outcome {
    let kind = args.kind.map(WaitKind::from);
    let waits = store
        .waits(kind, None, args.limit)
        .map_err(|e| e.to_string())?;
    let more = match waits.last() {
        Some(last) if waits.len() == args.limit => !store
            .waits(kind, Some(last), 1)
            .map_err(|e| e.to_string())?
            .is_empty(),
        _ => false,
    };
    if json {
        return print_json(&Listed {
            waits: &waits,
            more,
        });
    }
    let mut table = table(&["RUN", "STEP", "CALL", "KIND", "KEY", "SINCE", "DUE"]);
    for wait in &waits {
        table.add_row(vec![
            one_line(wait.run_id.as_str()),
            wait.step.to_string(),
            one_line(&wait.call_id),
            wait.kind.to_string(),
            one_line(key(wait)),
            time(wait.since),
            wait.due_at.map(time).unwrap_or_default(),
        ]);
    }
    out!("{}", table.trim_fmt());
    // On stderr: the table on stdout stays the waits alone.
    if more {
        eprintln!(
            "agentrt: more waits follow than --limit {} lists (at most {}); --kind narrows \
             the list",
            args.limit,
            agentrt::MAX_PAGE_LIMIT
        );
    }
    Ok(())
}

/// What a wait is keyed by, for people: the question (rather than its call id, the store's
/// key), the event's name, the timer's reason, or the child run's id.
fn key(wait: &Wait) -> &str {
    match wait.kind {
        WaitKind::Answer => wait.detail["question"].as_str().unwrap_or(&wait.key),
        _ => &wait.key,
    }
}

/// The lines `show` prints of a run's wait, each a label and its text.
pub(super) fn describe(wait: &Wait) -> Vec<(&'static str, String)> {
    let at = format!(
        "since {} (call {}, step {})",
        time(wait.since),
        one_line(&wait.call_id),
        wait.step
    );
    let mut lines = Vec::new();
    match wait.kind {
        WaitKind::Answer => {
            lines.push(("waits", format!("for an answer {at}")));
            lines.push(("question", one_line(key(wait))));
            if let Some(schema) = wait.detail.get("schema").filter(|s| !s.is_null()) {
                lines.push(("schema", schema.to_string()));
            }
        }
        WaitKind::Event => lines.push((
            "waits",
            format!("for event {} {at}", one_line(&format!("{:?}", wait.key))),
        )),
        WaitKind::Timer => {
            let due = wait.due_at.map(time).unwrap_or_else(|| "?".into());
            let then = if wait.detail["retry"] == Value::Bool(true) {
                "; the call is made again then"
            } else {
                ""
            };
            lines.push((
                "waits",
                format!("until {due}: {}{then}, {at}", one_line(&wait.key)),
            ));
        }
        WaitKind::Child => {
            let agent = wait.detail["agent"].as_str().unwrap_or("?");
            lines.push((
                "waits",
                format!(
                    "for child run {} (agent {}) {at}",
                    one_line(&wait.key),
                    one_line(agent)
                ),
            ));
        }
    }
    lines
}

/// `text` on one line with nothing that moves a terminal's cursor or reorders its text: a
/// question comes from a model, and is printed as it was asked, control characters and
/// bidirectional controls escaped.
fn one_line(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The argument, or stdin's whole text when it is `-` (less one final line break).
fn argument_or_stdin(argument: &str) -> Result<String, Failure> {
    if argument != "-" {
        return Ok(argument.to_owned());
    }
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read stdin: {e}"))?;
    let trimmed = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t));
    Ok(trimmed.map(str::to_owned).unwrap_or(text))
}

/// An answer as typed: JSON, or text that does not start as JSON does, taken as a JSON
/// string. Text that starts as an object, an array or a string does and is not JSON is
/// refused: it is most likely JSON mistyped, which a string would hide.
fn answer_value(text: &str) -> Result<Value, Failure> {
    if text.trim().is_empty() {
        return Err(
            "the answer is empty: give one (`'\"\"'` for an empty string); nothing was written"
                .into(),
        );
    }
    match serde_json::from_str(text) {
        Ok(value) => Ok(value),
        Err(err) if text.trim_start().starts_with(['{', '[', '"']) => Err(Failure::Message(
            format!("the answer starts as JSON but is not JSON ({err}); nothing was written"),
        )),
        Err(_) => Ok(Value::String(text.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_answer_is_json_or_text_taken_as_a_string() {
        let value = |text: &str| answer_value(text).ok();
        assert_eq!(
            value(r#"{"account": "savings"}"#),
            Some(json!({"account": "savings"}))
        );
        assert_eq!(value("42"), Some(json!(42)));
        assert_eq!(value("true"), Some(json!(true)));
        assert_eq!(value(r#""42""#), Some(json!("42")));
        assert_eq!(value("yes, go ahead"), Some(json!("yes, go ahead")));
        assert_eq!(value("12 apples"), Some(json!("12 apples")));
        for mistyped in [r#"{"account": savings}"#, "[1, 2", r#""unclosed"#, "", "  "] {
            assert_eq!(value(mistyped), None, "{mistyped:?}");
        }
    }

    #[test]
    fn text_from_a_model_cannot_drive_the_terminal() {
        assert_eq!(one_line("a\nb\u{1b}[31m"), "a\\u{a}b\\u{1b}[31m");
        assert_eq!(one_line("x\u{202e}y"), "x\\u{202e}y");
        assert_eq!(one_line("Which account?"), "Which account?");
    }
}
