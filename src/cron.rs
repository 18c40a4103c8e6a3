//! Cron expressions, read in UTC: five fields (minute, hour, day of the month, month, day of
//! the week), each `*`, a value, a range `a-b`, or a list of them, any of them with a step
//! (`*/15`, `1-30/2`, `5/10`); months and days of the week also by their English names' first
//! three letters (`JAN`, `MON`); Sunday is 0 or 7. `@hourly`, `@daily` (`@midnight`),
//! `@weekly`, `@monthly` and `@yearly` (`@annually`) stand for their expressions. As in cron,
//! when both day fields are restricted (neither starts with `*`), a day matches either.
//!
//! Times are milliseconds since the Unix epoch; an occurrence falls on a whole minute.

use crate::error::{Error, Result};

const MINUTE: i64 = 60_000;
const MINUTES_PER_DAY: i64 = 1440;

/// A parsed expression: the values each field matches, as bit sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cron {
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// The day of the month is restricted (its field does not start with `*`).
    days_restricted: bool,
    /// The day of the week is restricted.
    weekdays_restricted: bool,
}

/// One field's place and range, for parsing and for messages.
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const FIELDS: [Field; 5] = [
    Field {
        name: "minute",
        min: 0,
        max: 59,
        names: &[],
    },
    Field {
        name: "hour",
        min: 0,
        max: 23,
        names: &[],
    },
    Field {
        name: "day of the month",
        min: 1,
        max: 31,
        names: &[],
    },
    Field {
        name: "month",
        min: 1,
        max: 12,
        names: &[
            "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
        ],
    },
    Field {
        name: "day of the week",
        min: 0,
        // 7 is Sunday too, folded into 0.
        max: 7,
        names: &["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"],
    },
];

/// The expressions the `@` shorthands stand for.
const MACROS: &[(&str, &str)] = &[
    ("@yearly", "0 0 1 1 *"),
    ("@annually", "0 0 1 1 *"),
    ("@monthly", "0 0 1 * *"),
    ("@weekly", "0 0 * * 0"),
    ("@daily", "0 0 * * *"),
    ("@midnight", "0 0 * * *"),
    ("@hourly", "0 * * * *"),
];

/// The most days a month can have, by month (February in a leap year).
const MONTH_DAYS: [u32; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];

impl Cron {
    /// Parses `text`; an expression that is not one, or that no date ever matches (`0 0 30 2
    /// *`), is [`Error::InvalidInput`] saying what is wrong.
    pub(crate) fn parse(text: &str) -> Result<Cron> {
        let invalid = |why: String| Error::InvalidInput(format!("cron expression {text:?}: {why}"));
        let trimmed = text.trim();
        let expanded = if trimmed.starts_with('@') {
            MACROS
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(trimmed))
                .map(|(_, expression)| *expression)
                .ok_or_else(|| {
                    invalid(
                        "unknown shorthand: use @hourly, @daily, @midnight, @weekly, @monthly, \
                         @yearly or @annually"
                            .into(),
                    )
                })?
        } else {
            trimmed
        };
        let parts: Vec<&str> = expanded.split_whitespace().collect();
        if parts.len() != 5 {
            return Err(invalid(format!(
                "{} fields; a cron expression has five: minute, hour, day of the month, month, \
                 day of the week (UTC), such as \"0 2 * * *\" for 02:00 every day",
                parts.len()
            )));
        }
        let mut sets = [0u64; 5];
        for ((set, part), field) in sets.iter_mut().zip(&parts).zip(&FIELDS) {
            *set = field.parse(part).map_err(invalid)?;
        }
        // Sunday is 0 or 7.
        if sets[4] & (1 << 7) != 0 {
            sets[4] = (sets[4] | 1) & !(1 << 7);
        }
        let cron = Cron {
            minutes: sets[0],
            hours: sets[1],
            days: sets[2],
            months: sets[3],
            weekdays: sets[4],
            days_restricted: !parts[2].starts_with('*'),
            weekdays_restricted: !parts[4].starts_with('*'),
        };
        // Only the day of the month can name a date no month has; the day of the week, when
        // both are restricted, matches on its own.
        let possible = (1..=12).any(|month| {
            cron.months & (1 << month) != 0 && cron.days.trailing_zeros() <= MONTH_DAYS[month - 1]
        });
        let either_day = cron.days_restricted && cron.weekdays_restricted;
        if !possible && !either_day {
            return Err(invalid(
                "no date matches it: none of its months has that day".into(),
            ));
        }
        Ok(cron)
    }

    /// Whether the day `day` (days since the Unix epoch), `mday` of its month, matches.
    fn day_matches(&self, day: i64, mday: u32) -> bool {
        let weekday = (day + 4).rem_euclid(7); // 1970-01-01 was a Thursday.
        let by_day = self.days & (1 << mday) != 0;
        let by_weekday = self.weekdays & (1 << weekday) != 0;
        if self.days_restricted && self.weekdays_restricted {
            by_day || by_weekday
        } else {
            by_day && by_weekday
        }
    }

    /// The first occurrence strictly after `after`, or `None` if there is none within the
    /// next years searched (which [`Cron::parse`] makes sure cannot happen).
    pub(crate) fn next_after(&self, after: i64) -> Option<i64> {
        let mut minute = after.div_euclid(MINUTE) + 1;
        for _ in 0..SEARCH_STEPS {
            let (day, of_day) = (
                minute.div_euclid(MINUTES_PER_DAY),
                minute.rem_euclid(MINUTES_PER_DAY),
            );
            let (year, month, mday) = civil_from_days(day);
            let (hour, min) = (of_day / 60, of_day % 60);
            if self.months & (1 << month) == 0 {
                let (year, month) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                minute = days_from_civil(year, month, 1) * MINUTES_PER_DAY;
            } else if !self.day_matches(day, mday) {
                minute = (day + 1) * MINUTES_PER_DAY;
            } else if self.hours & (1 << hour) == 0 {
                minute = day * MINUTES_PER_DAY + (hour + 1) * 60;
            } else if self.minutes & (1 << min) == 0 {
                minute += 1;
            } else {
                return Some(minute * MINUTE);
            }
        }
        None
    }

    /// The last occurrence at or before `at`, or `None` if there is none within the years
    /// searched.
    pub(crate) fn latest_at_or_before(&self, at: i64) -> Option<i64> {
        let mut minute = at.div_euclid(MINUTE);
        for _ in 0..SEARCH_STEPS {
            let (day, of_day) = (
                minute.div_euclid(MINUTES_PER_DAY),
                minute.rem_euclid(MINUTES_PER_DAY),
            );
            let (year, month, mday) = civil_from_days(day);
            let (hour, min) = (of_day / 60, of_day % 60);
            if self.months & (1 << month) == 0 {
                minute = days_from_civil(year, month, 1) * MINUTES_PER_DAY - 1;
            } else if !self.day_matches(day, mday) {
                minute = day * MINUTES_PER_DAY - 1;
            } else if self.hours & (1 << hour) == 0 {
                minute = day * MINUTES_PER_DAY + hour * 60 - 1;
            } else if self.minutes & (1 << min) == 0 {
                minute -= 1;
            } else {
                return Some(minute * MINUTE);
            }
        }
        None
    }
}

/// How many jumps a search makes at most: a month, a day, an hour or a minute each, enough to
/// cross the eight years between two 29ths of February.
const SEARCH_STEPS: usize = 200_000;

impl Field {
    /// The values `text` matches, as a bit set; why not, for a message.
    fn parse(&self, text: &str) -> std::result::Result<u64, String> {
        let mut set = 0u64;
        for item in text.split(',') {
            set |= self
                .item(item)
                .map_err(|why| format!("the {} field {text:?}: {why}", self.name))?;
        }
        Ok(set)
    }

    fn item(&self, item: &str) -> std::result::Result<u64, String> {
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => {
                let step: u32 =
                    step.parse().ok().filter(|step| *step > 0).ok_or_else(|| {
                        format!("the step {step:?} is not a whole number above 0")
                    })?;
                (range, Some(step))
            }
            None => (item, None),
        };
        let (from, to) = if range == "*" {
            (self.min, self.max)
        } else if let Some((from, to)) = range.split_once('-') {
            let (from, to) = (self.value(from)?, self.value(to)?);
            if from > to {
                return Err(format!("the range {range:?} runs backwards"));
            }
            (from, to)
        } else {
            let value = self.value(range)?;
            // `5/10`: from 5 to the end, every 10th.
            (value, if step.is_some() { self.max } else { value })
        };
        let step = step.unwrap_or(1);
        Ok((from..=to)
            .step_by(step as usize)
            .fold(0, |set, value| set | (1 << value)))
    }

    fn value(&self, text: &str) -> std::result::Result<u32, String> {
        if let Some(at) = self
            .names
            .iter()
            .position(|name| name.eq_ignore_ascii_case(text))
        {
            return Ok(self.min + at as u32);
        }
        let value: u32 = text.parse().map_err(|_| {
            let names = match self.names.first() {
                Some(first) => format!(" or a name such as {first}"),
                None => String::new(),
            };
            format!(
                "{text:?} is not a number{names}: use *, a value, a range a-b or a list a,b, \
                 with /step if need be"
            )
        })?;
        if value < self.min || value > self.max {
            return Err(format!(
                "{value} is out of range: the {} is {} to {}",
                self.name, self.min, self.max
            ));
        }
        Ok(value)
    }
}

/// Days since the Unix epoch of a civil date (proleptic Gregorian), after Howard Hinnant's
/// algorithm.
pub(crate) fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let (y, m) = if month <= 2 {
        (year - 1, i64::from(month) + 9)
    } else {
        (year, i64::from(month) - 3)
    };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date (year, month, day) of a day since the Unix epoch: the inverse of
/// [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A time as `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds): how an occurrence is named in its
/// run's id.
pub(crate) fn utc_seconds(millis: i64) -> String {
    let seconds = millis.div_euclid(1000);
    let (day, of_day) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    let (year, month, mday) = civil_from_days(day);
    format!(
        "{year:04}-{month:02}-{mday:02}T{:02}:{:02}:{:02}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Milliseconds of a UTC time `YYYY-MM-DD HH:MM`.
    fn at(text: &str) -> i64 {
        crate::builtin::parse_rfc3339(&format!("{}:00Z", text.replace(' ', "T"))).unwrap()
    }

    fn next(cron: &str, after: &str) -> String {
        let cron = Cron::parse(cron).unwrap();
        utc_seconds(cron.next_after(at(after)).unwrap())
    }

    fn latest(cron: &str, at_or_before: &str) -> String {
        let cron = Cron::parse(cron).unwrap();
        utc_seconds(cron.latest_at_or_before(at(at_or_before)).unwrap())
    }

    #[test]
    fn the_next_occurrence_is_strictly_after_the_time_given() {
        assert_eq!(
            next("* * * * *", "2026-12-03 02:00"),
            "2026-12-03T02:01:00Z"
        );
        assert_eq!(
            next("0 2 * * *", "2026-12-03 02:00"),
            "2026-12-04T02:00:00Z"
        );
        assert_eq!(
            next("0 2 * * *", "2026-12-03 01:59"),
            "2026-12-03T02:00:00Z"
        );
        assert_eq!(
            next("*/15 * * * *", "2026-12-03 02:01"),
            "2026-12-03T02:15:00Z"
        );
        assert_eq!(
            next("30 9 * * MON-FRI", "2026-12-04 10:00"),
            "2026-12-07T09:30:00Z"
        );
        assert_eq!(
            next("0 0 1 */3 *", "2026-02-10 00:00"),
            "2026-04-01T00:00:00Z"
        );
        assert_eq!(next("@hourly", "2026-12-31 23:30"), "2027-01-01T00:00:00Z");
        assert_eq!(next("@yearly", "2026-06-01 00:00"), "2027-01-01T00:00:00Z");
        assert_eq!(
            next("0 12 29 2 *", "2025-03-01 00:00"),
            "2028-02-29T12:00:00Z"
        );
        assert_eq!(
            next("0 0 31 * *", "2026-04-01 00:00"),
            "2026-05-31T00:00:00Z"
        );
    }

    #[test]
    fn seconds_within_a_minute_do_not_make_it_an_occurrence_again() {
        let cron = Cron::parse("* * * * *").unwrap();
        let t = at("2026-12-03 02:00") + 59_999;
        assert_eq!(cron.next_after(t), Some(at("2026-12-03 02:01")));
        assert_eq!(cron.latest_at_or_before(t), Some(at("2026-12-03 02:00")));
    }

    #[test]
    fn the_latest_occurrence_is_at_or_before_the_time_given() {
        assert_eq!(
            latest("0 2 * * *", "2026-12-03 02:00"),
            "2026-12-03T02:00:00Z"
        );
        assert_eq!(
            latest("0 2 * * *", "2026-12-03 01:59"),
            "2026-12-02T02:00:00Z"
        );
        assert_eq!(
            latest("0 * * * *", "2027-01-01 00:30"),
            "2027-01-01T00:00:00Z"
        );
        assert_eq!(
            latest("0 0 1 1 *", "2026-06-01 00:00"),
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(
            latest("30 9 * * MON-FRI", "2026-12-07 09:00"),
            "2026-12-04T09:30:00Z"
        );
        assert_eq!(
            latest("0 12 29 2 *", "2028-02-28 00:00"),
            "2024-02-29T12:00:00Z"
        );
    }

    #[test]
    fn both_day_fields_restricted_match_either_as_cron_does() {
        // The 13th, and every Friday.
        let cron = "0 0 13 * 5";
        assert_eq!(next(cron, "2026-03-01 00:00"), "2026-03-06T00:00:00Z");
        assert_eq!(next(cron, "2026-03-12 00:00"), "2026-03-13T00:00:00Z");
        assert_eq!(next(cron, "2026-03-13 00:00"), "2026-03-20T00:00:00Z");
        // A star-led day of the month restricts by the day of the week alone.
        assert_eq!(
            next("0 0 */1 * 5", "2026-03-01 00:00"),
            "2026-03-06T00:00:00Z"
        );
    }

    #[test]
    fn lists_ranges_steps_names_and_sunday_as_seven_are_read() {
        assert_eq!(
            Cron::parse("0 0 * * 7").unwrap(),
            Cron::parse("0 0 * * sun").unwrap()
        );
        assert_eq!(
            Cron::parse("0,15,30,45 * * * *").unwrap(),
            Cron::parse("*/15 * * * *").unwrap()
        );
        assert_eq!(
            Cron::parse("0 0 * JAN-MAR *").unwrap(),
            Cron::parse("0 0 * 1,2,3 *").unwrap()
        );
        assert_eq!(
            Cron::parse("5/20 * * * *").unwrap(),
            Cron::parse("5,25,45 * * * *").unwrap()
        );
        assert_eq!(
            Cron::parse("  @DAILY ").unwrap(),
            Cron::parse("0 0 * * *").unwrap()
        );
    }

    #[test]
    fn an_invalid_expression_says_what_is_wrong() {
        let cases = [
            ("", "0 fields"),
            ("* * * *", "4 fields"),
            ("* * * * * *", "6 fields"),
            ("60 * * * *", "the minute field \"60\": 60 is out of range"),
            ("* 24 * * *", "the hour is 0 to 23"),
            ("* * 0 * *", "the day of the month is 1 to 31"),
            ("* * * 13 *", "the month is 1 to 12"),
            ("* * * * 8", "the day of the week is 0 to 7"),
            ("*/0 * * * *", "not a whole number above 0"),
            ("5-1 * * * *", "runs backwards"),
            ("x * * * *", "\"x\" is not a number"),
            ("* * * FOO *", "or a name such as JAN"),
            ("@reboot", "unknown shorthand"),
            ("0 0 30 2 *", "no date matches it"),
            ("0 0 31 4,6,9,11 *", "no date matches it"),
        ];
        for (text, why) in cases {
            match Cron::parse(text) {
                Err(Error::InvalidInput(message)) => {
                    assert!(message.contains(why), "{text:?}: {message}");
                    assert!(message.starts_with("cron expression"), "{message}");
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
        // Either day field may match on its own when both are restricted.
        assert!(Cron::parse("0 0 30 2 MON").is_ok());
    }

    #[test]
    fn civil_dates_round_trip_and_occurrences_are_named_in_utc() {
        for day in [-800_000, -1, 0, 1, 59, 365, 11_016, 20_000, 2_932_896] {
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day);
        }
        assert_eq!(utc_seconds(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_seconds(at("2026-12-03 02:00")), "2026-12-03T02:00:00Z");
        assert_eq!(utc_seconds(-1000), "1969-12-31T23:59:59Z");
    }
}
