//! The pull parser: a document's tokens in order, without recursion.

use super::error::{Error, ErrorKind};
use std::borrow::Cow;

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
