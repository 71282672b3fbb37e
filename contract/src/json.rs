//! The one JSON reader of the project.
//!
//! A pull parser ([`Parser`]) walks a UTF-8 document without recursion and reports each token
//! as an [`Event`]. Two readers sit on it:
//! * the request fingerprint ([`crate::fingerprint::canonicalize`]), which keeps numbers as
//!   written and needs every string decoded exactly;
//! * [`parse`], a small tree ([`Value`]) with integer-only numbers, for the documents the filter
//!   reads: its configuration and the state API's answers ([`crate::wire`]). [`Fields`] takes
//!   its objects apart with errors that name the field.
//!
//! serde_json's deserializer is not used in the filter: with the visitor code generated for
//! every type, its float parsing and the float formatting its errors pull in, it was a third
//! of the module Envoy loads. Writing JSON stays with serde_json.

use std::borrow::Cow;
use std::fmt;

/// One token of a document, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a> {
    ObjectStart,
    /// A member name, decoded; its value follows.
    Name(Cow<'a, str>),
    ObjectEnd,
    ArrayStart,
    ArrayEnd,
    Str(Cow<'a, str>),
    /// A number as written (it follows the RFC 8259 grammar).
    Number(&'a str),
    Bool(bool),
    Null,
}

/// What is wrong with a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Utf8,
    UnexpectedEnd,
    ExpectedValue,
    ExpectedName,
    ExpectedColon,
    ExpectedCommaOrBracket,
    ExpectedCommaOrBrace,
    InvalidNumber,
    UnterminatedString,
    ControlCharacter,
    InvalidEscape,
    InvalidUnicodeEscape,
    /// A `\uXXXX` escape leaves a surrogate unpaired: valid JSON, but not Unicode text.
    LoneSurrogate,
    /// More nested containers than the reader allows.
    TooDeep,
    Trailing,
    /// [`parse`] only: a number with a fraction or an exponent.
    NotAnInteger,
    /// [`parse`] only: an integer beyond 64 bits.
    OutOfRange,
}

impl ErrorKind {
    fn text(self) -> &'static str {
        match self {
            Self::Utf8 => "invalid UTF-8",
            Self::UnexpectedEnd => "unexpected end of input",
            Self::ExpectedValue => "expected a value",
            Self::ExpectedName => "expected a member name",
            Self::ExpectedColon => "expected `:`",
            Self::ExpectedCommaOrBracket => "expected `,` or `]`",
            Self::ExpectedCommaOrBrace => "expected `,` or `}`",
            Self::InvalidNumber => "invalid number",
            Self::UnterminatedString => "unterminated string",
            Self::ControlCharacter => "control character in a string",
            Self::InvalidEscape => "invalid escape",
            Self::InvalidUnicodeEscape => "invalid \\u escape",
            Self::LoneSurrogate => "lone surrogate",
            Self::TooDeep => "nested too deeply",
            Self::Trailing => "trailing characters",
            Self::NotAnInteger => "expected an integer (no fraction or exponent)",
            Self::OutOfRange => "number out of range",
        }
    }
}

/// An error and where it is (byte offset, and line and column counted from 1, columns in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub offset: usize,
    pub line: usize,
    pub column: usize,
}

impl Error {
    fn at(kind: ErrorKind, s: &[u8], offset: usize) -> Self {
        let before = s.get(..offset).unwrap_or(s);
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = offset
            - before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1)
            + 1;
        Self {
            kind,
            offset,
            line,
            column,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} at line {} column {}",
            self.kind.text(),
            self.line,
            self.column
        )
    }
}

impl std::error::Error for Error {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Object,
    Array,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value (the document, an array item after `,`, a member value after `:`).
    Value,
    /// Right after `[`.
    FirstItemOrEnd,
    /// Right after `{`.
    FirstNameOrEnd,
    /// A member name after `,`.
    Name,
    /// After a value inside a container.
    CommaOrEnd,
    /// After the document's value: only whitespace may follow.
    End,
}

/// A pull parser: [`Parser::next`] returns the events of the document in order, then `None`.
/// It never recurses, so no input grows the call stack; nesting beyond `max_depth` containers
/// is an error ([`ErrorKind::TooDeep`]).
#[derive(Debug)]
pub struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
    stack: Vec<Container>,
    expect: Expect,
    max_depth: usize,
}

impl<'a> Parser<'a> {
    pub fn new(bytes: &'a [u8], max_depth: usize) -> Result<Self, Error> {
        let text = std::str::from_utf8(bytes)
            .map_err(|e| Error::at(ErrorKind::Utf8, bytes, e.valid_up_to()))?;
        Ok(Self {
            s: bytes,
            text,
            pos: 0,
            stack: Vec::new(),
            expect: Expect::Value,
            max_depth,
        })
    }

    fn err(&self, kind: ErrorKind) -> Error {
        Error::at(kind, self.s, self.pos)
    }

    fn err_at(&self, kind: ErrorKind, offset: usize) -> Error {
        Error::at(kind, self.s, offset)
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// The next event, or `None` once the document is over (trailing whitespace only).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Event<'a>>, Error> {
        loop {
            self.skip_ws();
            match self.expect {
                Expect::End => {
                    return if self.pos < self.s.len() {
                        Err(self.err(ErrorKind::Trailing))
                    } else {
                        Ok(None)
                    };
                }
                Expect::Value => return self.value().map(Some),
                Expect::FirstItemOrEnd => {
                    if self.peek() == Some(b']') {
                        return Ok(Some(self.close(Event::ArrayEnd)));
                    }
                    return self.value().map(Some);
                }
                Expect::FirstNameOrEnd => {
                    if self.peek() == Some(b'}') {
                        return Ok(Some(self.close(Event::ObjectEnd)));
                    }
                    return self.name().map(Some);
                }
                Expect::Name => return self.name().map(Some),
                Expect::CommaOrEnd => {
                    let top = self.stack.last().copied();
                    match (self.peek(), top) {
                        (Some(b','), Some(Container::Array)) => {
                            self.pos += 1;
                            self.expect = Expect::Value;
                        }
                        (Some(b','), Some(Container::Object)) => {
                            self.pos += 1;
                            self.expect = Expect::Name;
                        }
                        (Some(b']'), Some(Container::Array)) => {
                            return Ok(Some(self.close(Event::ArrayEnd)))
                        }
                        (Some(b'}'), Some(Container::Object)) => {
                            return Ok(Some(self.close(Event::ObjectEnd)))
                        }
                        (_, Some(Container::Object)) => {
                            return Err(self.err(ErrorKind::ExpectedCommaOrBrace))
                        }
                        _ => return Err(self.err(ErrorKind::ExpectedCommaOrBracket)),
                    }
                }
            }
        }
    }

    /// Consumes the closing bracket of the innermost container.
    fn close(&mut self, event: Event<'a>) -> Event<'a> {
        self.pos += 1;
        self.stack.pop();
        self.after_value();
        event
    }

    fn after_value(&mut self) {
        self.expect = if self.stack.is_empty() {
            Expect::End
        } else {
            Expect::CommaOrEnd
        };
    }

    fn open(&mut self, c: Container) -> Result<(), Error> {
        if self.stack.len() >= self.max_depth {
            return Err(self.err(ErrorKind::TooDeep));
        }
        self.pos += 1;
        self.stack.push(c);
        self.expect = match c {
            Container::Object => Expect::FirstNameOrEnd,
            Container::Array => Expect::FirstItemOrEnd,
        };
        Ok(())
    }

    fn value(&mut self) -> Result<Event<'a>, Error> {
        let event = match self.peek() {
            Some(b'{') => {
                self.open(Container::Object)?;
                return Ok(Event::ObjectStart);
            }
            Some(b'[') => {
                self.open(Container::Array)?;
                return Ok(Event::ArrayStart);
            }
            Some(b'"') => Event::Str(self.string()?),
            Some(b't') => self.literal("true", Event::Bool(true))?,
            Some(b'f') => self.literal("false", Event::Bool(false))?,
            Some(b'n') => self.literal("null", Event::Null)?,
            Some(b'-' | b'0'..=b'9') => Event::Number(self.number()?),
            Some(_) => return Err(self.err(ErrorKind::ExpectedValue)),
            None => return Err(self.err(ErrorKind::UnexpectedEnd)),
        };
        self.after_value();
        Ok(event)
    }

    /// `"name"` and the `:` after it.
    fn name(&mut self) -> Result<Event<'a>, Error> {
        if self.peek() != Some(b'"') {
            return Err(self.err(ErrorKind::ExpectedName));
        }
        let name = self.string()?;
        self.skip_ws();
        if self.peek() != Some(b':') {
            return Err(self.err(ErrorKind::ExpectedColon));
        }
        self.pos += 1;
        self.expect = Expect::Value;
        Ok(Event::Name(name))
    }

    fn literal(&mut self, word: &str, event: Event<'a>) -> Result<Event<'a>, Error> {
        if self.s.get(self.pos..self.pos + word.len()) == Some(word.as_bytes()) {
            self.pos += word.len();
            Ok(event)
        } else {
            Err(self.err(ErrorKind::ExpectedValue))
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// A number per RFC 8259, as written.
    fn number(&mut self) -> Result<&'a str, Error> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let int_start = self.pos;
        let int_len = self.digits();
        if int_len == 0 || (int_len > 1 && self.s.get(int_start) == Some(&b'0')) {
            return Err(self.err_at(ErrorKind::InvalidNumber, int_start));
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.err(ErrorKind::InvalidNumber));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'-' | b'+')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.err(ErrorKind::InvalidNumber));
            }
        }
        self.text
            .get(start..self.pos)
            .ok_or_else(|| self.err_at(ErrorKind::InvalidNumber, start))
    }

    fn hex4(&mut self) -> Result<u32, Error> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return Err(self.err(ErrorKind::InvalidUnicodeEscape)),
            };
            v = (v << 4) | u32::from(d);
            self.pos += 1;
        }
        Ok(v)
    }

    /// Skips plain characters (not `"`, `\` or a control character). It stops on ASCII bytes
    /// only, so the run it skipped is whole UTF-8.
    fn plain_run(&mut self) -> usize {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c == b'"' || c == b'\\' || c < 0x20 {
                break;
            }
            self.pos += 1;
        }
        start
    }

    /// A string starting at its opening quote, decoded (borrowed when it has no escape).
    fn string(&mut self) -> Result<Cow<'a, str>, Error> {
        self.pos += 1;
        let start = self.plain_run();
        if self.peek() == Some(b'"') {
            let value = self
                .text
                .get(start..self.pos)
                .ok_or_else(|| self.err_at(ErrorKind::Utf8, start))?;
            self.pos += 1;
            return Ok(Cow::Borrowed(value));
        }
        let mut out = String::new();
        self.pos = start;
        loop {
            let run = self.plain_run();
            out.push_str(
                self.text
                    .get(run..self.pos)
                    .ok_or_else(|| self.err_at(ErrorKind::Utf8, run))?,
            );
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = match self.peek() {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            self.pos += 1;
                            out.push(self.unicode_escape()?);
                            continue;
                        }
                        _ => return Err(self.err(ErrorKind::InvalidEscape)),
                    };
                    out.push(c);
                    self.pos += 1;
                }
                Some(_) => return Err(self.err(ErrorKind::ControlCharacter)),
                None => return Err(self.err(ErrorKind::UnterminatedString)),
            }
        }
    }

    /// After `\u`: one escape, or a surrogate pair of two.
    fn unicode_escape(&mut self) -> Result<char, Error> {
        let at = self.pos;
        let hi = self.hex4()?;
        let code = if (0xD800..0xDC00).contains(&hi) {
            if self.s.get(self.pos..self.pos + 2) != Some(b"\\u") {
                return Err(self.err_at(ErrorKind::LoneSurrogate, at));
            }
            self.pos += 2;
            let lo = self.hex4()?;
            if !(0xDC00..0xE000).contains(&lo) {
                return Err(self.err_at(ErrorKind::LoneSurrogate, at));
            }
            0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
        } else {
            hi
        };
        char::from_u32(code).ok_or_else(|| self.err_at(ErrorKind::LoneSurrogate, at))
    }

    /// Where the parser is (a byte offset), for errors found by a reader on top.
    pub fn offset(&self) -> usize {
        self.pos
    }

    /// An error of `kind` at byte `offset` of this document.
    pub fn error_at(&self, kind: ErrorKind, offset: usize) -> Error {
        self.err_at(kind, offset)
    }
}

// ---------------------------------------------------------------------------------------------
// The tree
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Objects by field
// ---------------------------------------------------------------------------------------------

/// The members of an object, read by name. `what` names the object in messages (`state_api`,
/// `routes[1]`; empty at the top level).
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    members: &'a [(String, Value)],
    what: &'a str,
}

impl<'a> Fields<'a> {
    /// `v` must be an object without duplicate member names.
    pub fn of(v: &'a Value, what: &'a str) -> Result<Self, String> {
        let Value::Object(members) = v else {
            let what = if what.is_empty() {
                "the document"
            } else {
                what
            };
            return Err(format!("{what} must be an object, not {}", v.kind()));
        };
        let f = Self { members, what };
        for (i, (name, _)) in members.iter().enumerate() {
            if members.iter().take(i).any(|(n, _)| n == name) {
                return Err(format!("duplicate field `{name}`{}", f.within()));
            }
        }
        Ok(f)
    }

    /// ` in <what>`, or nothing at the top level.
    fn within(&self) -> String {
        if self.what.is_empty() {
            String::new()
        } else {
            format!(" in {}", self.what)
        }
    }

    /// `<what>.<name>`, or `<name>` at the top level.
    pub fn path(&self, name: &str) -> String {
        if self.what.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.what)
        }
    }

    fn missing(&self, name: &str) -> String {
        format!("missing field `{name}`{}", self.within())
    }

    fn wrong(&self, name: &str, expected: &str, v: &Value) -> String {
        format!("{} must be {expected}, not {}", self.path(name), v.kind())
    }

    /// Refuses a member not in `known`.
    pub fn deny_unknown(&self, known: &[&str]) -> Result<(), String> {
        match self
            .members
            .iter()
            .find(|(n, _)| !known.contains(&n.as_str()))
        {
            Some((name, _)) => Err(format!(
                "unknown field `{name}`{}, expected one of {}",
                self.within(),
                quoted(known)
            )),
            None => Ok(()),
        }
    }

    /// The member, `None` when absent or `null`.
    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.members
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .filter(|v| **v != Value::Null)
    }

    pub fn required(&self, name: &str) -> Result<&'a Value, String> {
        self.get(name).ok_or_else(|| self.missing(name))
    }

    pub fn opt_u64(&self, name: &str) -> Result<Option<u64>, String> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong(name, "a non-negative integer", v))
            })
            .transpose()
    }

    pub fn u64(&self, name: &str) -> Result<u64, String> {
        self.opt_u64(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn u64_or(&self, name: &str, default: u64) -> Result<u64, String> {
        Ok(self.opt_u64(name)?.unwrap_or(default))
    }

    pub fn i64(&self, name: &str) -> Result<i64, String> {
        let v = self.required(name)?;
        v.as_i64()
            .ok_or_else(|| self.wrong(name, "a 64-bit integer", v))
    }

    pub fn bool(&self, name: &str) -> Result<bool, String> {
        self.opt_bool(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn bool_or(&self, name: &str, default: bool) -> Result<bool, String> {
        Ok(self.opt_bool(name)?.unwrap_or(default))
    }

    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(name, "a boolean", v)),
        }
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<&'a str>, String> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(name, "a string", v)),
        }
    }

    pub fn str(&self, name: &str) -> Result<&'a str, String> {
        self.opt_str(name)?.ok_or_else(|| self.missing(name))
    }

    /// An array of strings (absent: empty).
    pub fn strings(&self, name: &str) -> Result<Vec<String>, String> {
        match self.get(name) {
            None => Ok(Vec::new()),
            // An item that is no string is named with its index (`routes[0].x[2]`).
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(str::to_owned).ok_or_else(|| {
                        format!(
                            "{}[{i}] must be a string, not {}",
                            self.path(name),
                            v.kind()
                        )
                    })
                })
                .collect(),
            Some(v) => Err(self.wrong(name, "an array of strings", v)),
        }
    }

    /// An array of `[name, value]` string pairs (absent: empty).
    pub fn string_pairs(&self, name: &str) -> Result<Vec<(String, String)>, String> {
        let wrong = || format!("{} must hold [name, value] string pairs", self.path(name));
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|h| match h {
                    Value::Array(pair) => match pair.as_slice() {
                        [Value::Str(n), Value::Str(v)] => Ok((n.clone(), v.clone())),
                        _ => Err(wrong()),
                    },
                    _ => Err(wrong()),
                })
                .collect(),
            Some(v) => Err(self.wrong(name, "an array", v)),
        }
    }

    /// One of `variants` by name (a string member); `default` when absent.
    pub fn variant<T: Copy>(
        &self,
        name: &str,
        variants: &[(&str, T)],
        default: Option<T>,
    ) -> Result<T, String> {
        let v = match (self.get(name), default) {
            (None, Some(d)) => return Ok(d),
            (None, None) => return Err(self.missing(name)),
            (Some(v), _) => v,
        };
        let s = v.as_str().ok_or_else(|| self.wrong(name, "a string", v))?;
        variants
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, t)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = variants.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown variant `{s}` for {}, expected one of {}",
                    self.path(name),
                    quoted(&names)
                )
            })
    }
}

fn quoted(names: &[&str]) -> String {
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('`');
        out.push_str(n);
        out.push('`');
    }
    out
}

#[cfg(test)]
mod tests;
