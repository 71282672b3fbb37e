//! The tree: [`parse`] reads a document into a [`Value`], numbers integers only.

use super::error::{Error, ErrorKind};
use super::parser::{Event, Parser};

/// Deepest nesting [`parse`] accepts (the configuration and the answers are 4 levels deep).
pub const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    Bool(bool),
    /// An integer, as sign and magnitude (fits both `i64` and `u64` values).
    Int {
        negative: bool,
        magnitude: u64,
    },
    Str(String),
    Array(Vec<Value>),
    /// Members in document order (duplicates kept; [`Fields`] refuses them).
    Object(Vec<(String, Value)>),
}

impl Value {
    /// What it is, for messages ("a string", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int { .. } => "an integer",
            Value::Str(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int {
                negative: false,
                magnitude,
            } => Some(magnitude),
            Value::Int {
                negative: true,
                magnitude: 0,
            } => Some(0),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Int {
                negative: false,
                magnitude,
            } => i64::try_from(magnitude).ok(),
            Value::Int {
                negative: true,
                magnitude,
            } => 0i64.checked_sub_unsigned(magnitude),
            _ => None,
        }
    }
}

/// An integer-only number: `Err(kind)` for a fraction, an exponent or more than 64 bits.
fn integer(text: &str) -> Result<Value, ErrorKind> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, text),
    };
    if digits.bytes().any(|b| !b.is_ascii_digit()) {
        return Err(ErrorKind::NotAnInteger);
    }
    let magnitude = digits.parse::<u64>().map_err(|_| ErrorKind::OutOfRange)?;
    Ok(Value::Int {
        negative,
        magnitude,
    })
}

/// A container being filled: its items, or its members and the name of the next one.
enum Partial {
    Array(Vec<Value>),
    Object(Vec<(String, Value)>, String),
}

/// Reads a whole document into a [`Value`] (numbers must be integers; at most [`MAX_DEPTH`]
/// levels), without recursion.
pub fn parse(bytes: &[u8]) -> Result<Value, Error> {
    let mut p = Parser::new(bytes, MAX_DEPTH)?;
    let mut stack: Vec<Partial> = Vec::new();
    loop {
        let at = p.offset();
        let Some(event) = p.next()? else {
            // `next` returns None only after the document's value.
            return Err(p.error_at(ErrorKind::UnexpectedEnd, at));
        };
        let done = match event {
            Event::ObjectStart => {
                stack.push(Partial::Object(Vec::new(), String::new()));
                continue;
            }
            Event::ArrayStart => {
                stack.push(Partial::Array(Vec::new()));
                continue;
            }
            Event::Name(n) => {
                if let Some(Partial::Object(_, pending)) = stack.last_mut() {
                    *pending = n.into_owned();
                }
                continue;
            }
            Event::ObjectEnd | Event::ArrayEnd => match stack.pop() {
                Some(Partial::Object(members, _)) => Value::Object(members),
                Some(Partial::Array(items)) => Value::Array(items),
                None => return Err(p.error_at(ErrorKind::ExpectedValue, at)),
            },
            Event::Str(s) => Value::Str(s.into_owned()),
            Event::Number(n) => {
                let start = p.offset() - n.len();
                integer(n).map_err(|kind| p.error_at(kind, start))?
            }
            Event::Bool(b) => Value::Bool(b),
            Event::Null => Value::Null,
        };
        match stack.last_mut() {
            None => {
                // The document's value: nothing but whitespace may follow.
                return match p.next()? {
                    None => Ok(done),
                    Some(_) => Err(p.error_at(ErrorKind::Trailing, p.offset())),
                };
            }
            Some(Partial::Array(items)) => items.push(done),
            Some(Partial::Object(members, pending)) => {
                members.push((std::mem::take(pending), done));
            }
        }
    }
}
