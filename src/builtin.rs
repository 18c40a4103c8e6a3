//! The built-in tools that make a run wait: `ask_person`, `sleep_until`, `wait_for_event`, and
//! the delegating tools that hand a task to a child run. The loop does not call them: it reads
//! their arguments into a wait, recorded with the call's step.

use serde_json::{Value, json};

use crate::{
    agent::{Tool, ToolContext, ToolError},
    store::moves::WaitRequest,
};

/// The deepest a tree of child runs goes by default: a root, and runs down to this many
/// levels below it.
pub const DEFAULT_MAX_DEPTH: u32 = 5;

/// The longest `sleep_until` may sleep: a year, in milliseconds.
const MAX_SLEEP_MS: i64 = 366 * 86_400_000;

/// What a built-in tool waits for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WaitTool {
    Answer,
    Timer,
    Event,
    Child { agent: String, max_depth: u32 },
}

impl WaitTool {
    /// The wait a call with `args` asks for, at `now` (milliseconds by `Config::clock`);
    /// `Err` with what the model is told when its arguments cannot make one.
    pub(crate) fn request(&self, args: &Value, now: i64) -> Result<WaitRequest, String> {
        match self {
            WaitTool::Answer => {
                let schema = args.get("schema").filter(|s| !s.is_null()).cloned();
                // A schema no answer could be checked against would leave the run waiting for
                // ever: the model is told now.
                if let Some(schema) = &schema {
                    jsonschema::options()
                        .build(schema)
                        .map_err(|err| format!("\"schema\" is not a valid JSON Schema: {err}"))?;
                }
                Ok(WaitRequest::Answer {
                    question: text(args, "question")?,
                    schema,
                })
            }
            WaitTool::Event => Ok(WaitRequest::Event {
                name: text(args, "name")?,
            }),
            WaitTool::Timer => {
                let reason = args
                    .get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or("sleep")
                    .to_owned();
                let at = match (args.get("seconds"), args.get("until")) {
                    (Some(seconds), _) => {
                        let seconds = seconds
                            .as_f64()
                            .filter(|s| s.is_finite() && *s >= 0.0)
                            .ok_or("\"seconds\" must be a number of seconds, 0 or more")?;
                        if seconds * 1000.0 > MAX_SLEEP_MS as f64 {
                            return Err("a run sleeps at most a year".into());
                        }
                        now + (seconds * 1000.0) as i64
                    }
                    (None, Some(until)) => {
                        let until = until.as_str().ok_or("\"until\" must be a string")?;
                        parse_rfc3339(until).ok_or_else(|| {
                            format!(
                                "\"until\" must be a UTC time such as 2026-01-31T09:00:00Z, \
                                 not {until:?}"
                            )
                        })?
                    }
                    (None, None) => return Err("give \"seconds\" or \"until\"".into()),
                };
                if at - now > MAX_SLEEP_MS {
                    return Err("a run sleeps at most a year".into());
                }
                Ok(WaitRequest::Timer {
                    at,
                    reason,
                    retry: false,
                })
            }
            WaitTool::Child { agent, max_depth } => Ok(WaitRequest::Child {
                agent: agent.clone(),
                input: args.get("task").cloned().unwrap_or_else(|| args.clone()),
                max_depth: *max_depth,
            }),
        }
    }
}

fn text(args: &Value, field: &str) -> Result<String, String> {
    args.get(field)
        .and_then(Value::as_str)
        .filter(|text| !text.trim().is_empty())
        .map(str::to_owned)
        .ok_or_else(|| format!("{field:?} must be a string that is not empty"))
}

/// `YYYY-MM-DDTHH:MM:SS[.fff](Z|+HH:MM|-HH:MM)` as milliseconds since the Unix epoch.
pub(crate) fn parse_rfc3339(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let part = text.get(from..from + len)?;
        part.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| part.parse().ok())?
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    if second > 60 {
        return None;
    }
    let mut at = 19;
    let mut millis = 0;
    if b.get(at) == Some(&b'.') {
        let digits = b[at + 1..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        if digits == 0 {
            return None;
        }
        let fraction = &text[at + 1..at + 1 + digits.min(3)];
        millis = fraction.parse::<i64>().ok()? * 10_i64.pow(3 - digits.min(3) as u32);
        at += 1 + digits;
    }
    let offset = match b.get(at)? {
        b'Z' | b'z' if at + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if at + 6 == b.len() && b[at + 3] == b':' => {
            let minutes = num(at + 1, 2)? * 60 + num(at + 4, 2)?;
            if *sign == b'+' { minutes } else { -minutes }
        }
        _ => return None,
    };
    let days = crate::cron::days_from_civil(year, month as u32, day as u32);
    let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset * 60;
    Some(seconds * 1000 + millis)
}

/// A built-in tool as the model sees it: its name, description and schema. It is never
/// called: the loop makes its wait instead.
pub(crate) struct BuiltIn {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) parameters: Value,
}

#[async_trait::async_trait(?Send)]
impl Tool for BuiltIn {
    fn name(&self) -> &str {
        &self.name
    }

    fn description(&self) -> &str {
        &self.description
    }

    fn parameters(&self) -> Value {
        self.parameters.clone()
    }

    /// Waiting twice for the same thing is waiting once: an interrupted wait begins again.
    fn idempotent(&self) -> bool {
        true
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        Err(ToolError::new("a built-in tool waits; it is not called"))
    }
}

/// `ask_person`: a question for a person, with an optional JSON Schema for the answer.
pub(crate) fn ask_person() -> BuiltIn {
    BuiltIn {
        name: "ask_person".into(),
        description: "Ask a person a question and wait for the answer, which is the result. \
                      Give a JSON Schema in `schema` when the answer must have a shape."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "question": { "type": "string", "description": "What to ask." },
                "schema": { "type": "object", "description": "A JSON Schema the answer must match." }
            },
            "required": ["question"]
        }),
    }
}

/// `sleep_until`: wake the run at a time, or after a number of seconds.
pub(crate) fn sleep_until() -> BuiltIn {
    BuiltIn {
        name: "sleep_until".into(),
        description: "Pause the run until a time (`until`, UTC, RFC 3339) or for a number of \
                      `seconds`, with a `reason`. Costs nothing while it sleeps."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": {
                "until": { "type": "string", "description": "A UTC time, such as 2026-01-31T09:00:00Z." },
                "seconds": { "type": "number", "minimum": 0 },
                "reason": { "type": "string" }
            }
        }),
    }
}

/// `wait_for_event`: wait for an event of a name delivered to the run; its payload is the
/// result.
pub(crate) fn wait_for_event() -> BuiltIn {
    BuiltIn {
        name: "wait_for_event".into(),
        description: "Wait for an event of a name (a webhook, a payment, a signal) delivered \
                      to this run; its payload is the result."
            .into(),
        parameters: json!({
            "type": "object",
            "properties": { "name": { "type": "string" } },
            "required": ["name"]
        }),
    }
}

/// A tool that hands `task` to a child run of another agent, whose final answer is the result.
pub(crate) fn delegate(name: &str, description: &str) -> BuiltIn {
    BuiltIn {
        name: name.into(),
        description: description.into(),
        parameters: json!({
            "type": "object",
            "properties": { "task": { "description": "The task, as the child run's input." } },
            "required": ["task"]
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_are_read_in_utc_with_offsets_and_fractions() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(parse_rfc3339("2000-03-01T00:00:00Z"), Some(951_868_800_000));
        assert_eq!(parse_rfc3339("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(parse_rfc3339("1969-12-31T23:00:00-01:00"), Some(0));
        for bad in [
            "",
            "2026-13-01T00:00:00Z",
            "2026-01-01 00:00",
            "2026-01-01T00:00:00",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }
}
