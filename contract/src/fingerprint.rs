//! Request fingerprints: SHA-256 over the method, the endpoint path, the query and the body.
//!
//! The same key sent again with a *different* request must be refused (422), and the same
//! request sent again must be recognised even if a client library re-serialized its JSON with
//! another member order or other whitespace. So JSON bodies are hashed in a canonical form:
//!
//! * **`sha256-jcs-v1`**: the body is JSON (by `Content-Type`: `application/json` or any
//!   `+json` type) and it parses. The canonical form follows RFC 8785 (JCS): no insignificant
//!   whitespace, object members sorted by the UTF-16 code units of their names at every depth,
//!   strings re-escaped the JCS way. One deliberate difference: **numbers keep their exact
//!   decimal value**. JCS reads numbers as IEEE-754 doubles, which would make `9007199254740993`
//!   and `9007199254740992` the same amount. Here a number is reduced to its exact decimal
//!   (sign, significant digits, exponent) and printed in the ECMAScript `Number::toString`
//!   layout; that output equals JCS whenever the number as written is the shortest
//!   representation of a double (so `1`, `1.0`, `1e0` and `10e-1` are all `1`), and two
//!   different decimal values never share a form.
//! * **`sha256-raw-v1`**: everything else — other content types, a body that is not valid JSON,
//!   strings with lone surrogates (`"\ud800"`, not representable as Unicode text), numbers
//!   beyond the range of a double or with absurd exponents, and nesting deeper than
//!   [`MAX_DEPTH`]. The raw bytes are hashed: byte-identical retries still match, only the
//!   re-ordering tolerance is lost.
//!
//! A JSON object with the same member name twice is refused ([`FingerprintError::DuplicateMember`],
//! answered 400): two parsers could read it as two different requests.
//!
//! The hash input frames every field with its length, so no two different
//! (algorithm, method, path, query, body) tuples share an input.
//!
//! The parser is iterative: no input, however deep, grows the call stack.

use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

/// Fingerprint algorithm over the canonical JSON form.
pub const ALG_JCS: &str = "sha256-jcs-v1";
/// Fingerprint algorithm over the raw body bytes.
pub const ALG_RAW: &str = "sha256-raw-v1";
/// Deepest array/object nesting that is canonicalized; deeper documents are hashed raw.
pub const MAX_DEPTH: usize = 128;
/// Exponents (as written) longer than this many digits are not canonicalized.
const MAX_EXPONENT_DIGITS: usize = 9;

/// A request fingerprint and the algorithm that made it (stored and compared together).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// [`ALG_JCS`] or [`ALG_RAW`].
    pub alg: &'static str,
    /// Lower-case hex SHA-256, 64 characters.
    pub hex: String,
}

/// Why a request cannot be fingerprinted (it must be refused).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintError {
    /// A JSON object has this member name twice.
    DuplicateMember(String),
}

impl fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DuplicateMember(name) => {
                write!(
                    f,
                    "a JSON object in the body has the member {name:?} more than once"
                )
            }
        }
    }
}

impl std::error::Error for FingerprintError {}

/// Why a body could not be canonicalized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// Not valid JSON (RFC 8259), including invalid UTF-8 and unescaped control characters.
    Syntax { offset: usize },
    /// Valid JSON, but an object has this member name twice.
    DuplicateMember(String),
    /// Valid so far, but nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A `\uXXXX` escape leaves a surrogate unpaired.
    LoneSurrogate,
    /// A number overflows a double, or its exponent is absurdly long.
    NumberOutOfRange,
}

/// True for `application/json` and any `*/*+json` media type (parameters and case ignored).
pub fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    !kind.is_empty()
        && (essence == "application/json" || (subtype.ends_with("+json") && subtype.len() > 5))
}

/// Fingerprint a request. `path` excludes the query; `query` is the raw text after `?` (empty
/// when none). JSON content types are canonicalized; everything else is hashed raw.
pub fn fingerprint(
    method: &str,
    path: &str,
    query: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Fingerprint, FingerprintError> {
    if content_type.is_some_and(is_json_content_type) {
        match canonicalize(body) {
            Ok(canonical) => return Ok(hash(ALG_JCS, method, path, query, &canonical)),
            Err(CanonError::DuplicateMember(name)) => {
                return Err(FingerprintError::DuplicateMember(name))
            }
            Err(_) => {}
        }
    }
    Ok(hash(ALG_RAW, method, path, query, body))
}

fn hash(alg: &'static str, method: &str, path: &str, query: &str, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    for field in [
        alg.as_bytes(),
        method.as_bytes(),
        path.as_bytes(),
        query.as_bytes(),
        body,
    ] {
        h.update((field.len() as u64).to_be_bytes());
        h.update(field);
    }
    let digest = h.finalize();
    let mut hex = String::with_capacity(64);
    for b in digest.iter() {
        hex.push(HEX[usize::from(b >> 4)] as char);
        hex.push(HEX[usize::from(b & 0x0f)] as char);
    }
    Fingerprint { alg, hex }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

// ---------------------------------------------------------------------------------------------
// Canonical JSON
// ---------------------------------------------------------------------------------------------

/// Strings and numbers borrow from the input when their canonical text is the text as written.
enum Node<'a> {
    Literal(&'static str),
    /// Canonical number text.
    Number(Cow<'a, str>),
    /// Decoded string value.
    Str(Cow<'a, str>),
    Array(Vec<usize>),
    /// Members sorted by UTF-16 code units of the name.
    Object(Vec<(Cow<'a, str>, usize)>),
}

enum Frame<'a> {
    Array(Vec<usize>),
    Object {
        members: Vec<(Cow<'a, str>, usize)>,
        pending_key: Cow<'a, str>,
    },
}

/// The canonical form of a JSON text (see the module documentation), or why there is none.
pub fn canonicalize(input: &[u8]) -> Result<Vec<u8>, CanonError> {
    let text = std::str::from_utf8(input).map_err(|e| CanonError::Syntax {
        offset: e.valid_up_to(),
    })?;
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
    };
    let mut nodes: Vec<Node> = Vec::new();
    let mut stack: Vec<Frame> = Vec::new();
    let mut duplicate: Option<String> = None;

    let root = 'parse: loop {
        // Parse one value (or open a container).
        p.skip_ws();
        let mut done: usize = match p.peek() {
            Some(b'{') => {
                p.pos += 1;
                if stack.len() >= MAX_DEPTH {
                    return Err(CanonError::TooDeep);
                }
                p.skip_ws();
                if p.peek() == Some(b'}') {
                    p.pos += 1;
                    push(&mut nodes, Node::Object(Vec::new()))
                } else {
                    let key = p.member_name()?;
                    stack.push(Frame::Object {
                        members: Vec::new(),
                        pending_key: key,
                    });
                    continue 'parse;
                }
            }
            Some(b'[') => {
                p.pos += 1;
                if stack.len() >= MAX_DEPTH {
                    return Err(CanonError::TooDeep);
                }
                p.skip_ws();
                if p.peek() == Some(b']') {
                    p.pos += 1;
                    push(&mut nodes, Node::Array(Vec::new()))
                } else {
                    stack.push(Frame::Array(Vec::new()));
                    continue 'parse;
                }
            }
            Some(b'"') => {
                let s = p.string()?;
                push(&mut nodes, Node::Str(s))
            }
            Some(b't') => {
                p.literal("true")?;
                push(&mut nodes, Node::Literal("true"))
            }
            Some(b'f') => {
                p.literal("false")?;
                push(&mut nodes, Node::Literal("false"))
            }
            Some(b'n') => {
                p.literal("null")?;
                push(&mut nodes, Node::Literal("null"))
            }
            Some(b'-' | b'0'..=b'9') => {
                let n = p.number()?;
                push(&mut nodes, Node::Number(n))
            }
            _ => return Err(p.err()),
        };

        // A value is complete: attach it to its container, and close containers as they end.
        loop {
            let Some(frame) = stack.last_mut() else {
                p.skip_ws();
                if p.pos != p.s.len() {
                    return Err(p.err());
                }
                break 'parse done;
            };
            match frame {
                Frame::Array(items) => {
                    items.push(done);
                    p.skip_ws();
                    match p.peek() {
                        Some(b',') => {
                            p.pos += 1;
                            continue 'parse;
                        }
                        Some(b']') => {
                            p.pos += 1;
                            let items = std::mem::take(items);
                            stack.pop();
                            done = push(&mut nodes, Node::Array(items));
                        }
                        _ => return Err(p.err()),
                    }
                }
                Frame::Object {
                    members,
                    pending_key,
                } => {
                    members.push((std::mem::take(pending_key), done));
                    p.skip_ws();
                    match p.peek() {
                        Some(b',') => {
                            p.pos += 1;
                            p.skip_ws();
                            *pending_key = p.member_name()?;
                            continue 'parse;
                        }
                        Some(b'}') => {
                            p.pos += 1;
                            let mut members = std::mem::take(members);
                            stack.pop();
                            members.sort_unstable_by(|a, b| utf16_cmp(&a.0, &b.0));
                            if duplicate.is_none() {
                                if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
                                    duplicate = Some(w[0].0.to_string());
                                }
                            }
                            done = push(&mut nodes, Node::Object(members));
                        }
                        _ => return Err(p.err()),
                    }
                }
            }
        }
    };

    if let Some(name) = duplicate {
        return Err(CanonError::DuplicateMember(name));
    }
    Ok(serialize(&nodes, root, input.len()))
}

fn push<'a>(nodes: &mut Vec<Node<'a>>, node: Node<'a>) -> usize {
    nodes.push(node);
    nodes.len() - 1
}

/// Compares as sequences of UTF-16 code units (JCS member order), without transcoding: byte
/// order is code point order, and the two orders differ only where a supplementary character
/// (a surrogate pair in UTF-16) meets U+E000..U+FFFF, so only the first differing character is
/// looked at.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    let (ab, bb) = (a.as_bytes(), b.as_bytes());
    let Some(mut i) = ab.iter().zip(bb).position(|(x, y)| x != y) else {
        return ab.len().cmp(&bb.len());
    };
    // Equal bytes before `i`: both strings have their char boundaries at the same places.
    while i > 0 && !a.is_char_boundary(i) {
        i -= 1;
    }
    let first_unit = |c: Option<char>| {
        c.map(|c| {
            let cp = u32::from(c);
            let unit = if cp >= 0x10000 {
                0xD800 + ((cp - 0x10000) >> 10)
            } else {
                cp
            };
            (unit, cp)
        })
    };
    let ca = a.get(i..).and_then(|r| r.chars().next());
    let cb = b.get(i..).and_then(|r| r.chars().next());
    first_unit(ca).cmp(&first_unit(cb))
}

enum Work<'a> {
    Node(usize),
    Byte(u8),
    Name(&'a str),
}

fn serialize(nodes: &[Node<'_>], root: usize, hint: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(hint);
    let mut work = vec![Work::Node(root)];
    while let Some(w) = work.pop() {
        match w {
            Work::Byte(b) => out.push(b),
            Work::Name(s) => write_string(&mut out, s),
            Work::Node(i) => match nodes.get(i) {
                Some(Node::Literal(l)) => out.extend_from_slice(l.as_bytes()),
                Some(Node::Number(n)) => out.extend_from_slice(n.as_bytes()),
                Some(Node::Str(s)) => write_string(&mut out, s),
                Some(Node::Array(items)) => {
                    work.push(Work::Byte(b']'));
                    for (j, item) in items.iter().enumerate().rev() {
                        work.push(Work::Node(*item));
                        if j > 0 {
                            work.push(Work::Byte(b','));
                        }
                    }
                    out.push(b'[');
                }
                Some(Node::Object(members)) => {
                    work.push(Work::Byte(b'}'));
                    for (j, (name, value)) in members.iter().enumerate().rev() {
                        work.push(Work::Node(*value));
                        work.push(Work::Byte(b':'));
                        work.push(Work::Name(name));
                        if j > 0 {
                            work.push(Work::Byte(b','));
                        }
                    }
                    out.push(b'{');
                }
                None => {}
            },
        }
    }
    out
}

/// JCS string serialization (ECMAScript `JSON.stringify` of a string).
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x00..=0x1f => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0x0f)]);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn err(&self) -> CanonError {
        CanonError::Syntax { offset: self.pos }
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &str) -> Result<(), CanonError> {
        if self.s.get(self.pos..self.pos + word.len()) == Some(word.as_bytes()) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.err())
        }
    }

    /// `"name"` followed by `:` (whitespace allowed around the colon).
    fn member_name(&mut self) -> Result<Cow<'a, str>, CanonError> {
        if self.peek() != Some(b'"') {
            return Err(self.err());
        }
        let name = self.string()?;
        self.skip_ws();
        if self.peek() != Some(b':') {
            return Err(self.err());
        }
        self.pos += 1;
        Ok(name)
    }

    fn hex4(&mut self) -> Result<u16, CanonError> {
        let mut v: u16 = 0;
        for _ in 0..4 {
            let d = match self.peek() {
                Some(c @ b'0'..=b'9') => c - b'0',
                Some(c @ b'a'..=b'f') => c - b'a' + 10,
                Some(c @ b'A'..=b'F') => c - b'A' + 10,
                _ => return Err(self.err()),
            };
            v = (v << 4) | u16::from(d);
            self.pos += 1;
        }
        Ok(v)
    }

    /// A string starting at the opening quote; returns the decoded value.
    fn string(&mut self) -> Result<Cow<'a, str>, CanonError> {
        self.pos += 1;
        // Fast path: no escape before the closing quote, the value is the text as written.
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c == b'"' || c == b'\\' || c < 0x20 {
                break;
            }
            self.pos += 1;
        }
        if self.peek() == Some(b'"') {
            let value = self
                .text
                .get(start..self.pos)
                .ok_or(CanonError::Syntax { offset: start })?;
            self.pos += 1;
            return Ok(Cow::Borrowed(value));
        }
        self.pos = start;
        let mut out = String::new();
        loop {
            // Copy a run of plain characters at once.
            let start = self.pos;
            while let Some(c) = self.peek() {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // `start..pos` lies on char boundaries: it stops only at ASCII bytes.
            out.push_str(
                self.text
                    .get(start..self.pos)
                    .ok_or(CanonError::Syntax { offset: start })?,
            );
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(Cow::Owned(out));
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = self.peek().ok_or_else(|| self.err())?;
                    self.pos += 1;
                    match c {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let hi = self.hex4()?;
                            let ch = if (0xD800..0xDC00).contains(&hi) {
                                if self.s.get(self.pos..self.pos + 2) != Some(b"\\u") {
                                    // Keep validating the rest: invalid JSON stays a syntax error.
                                    return Err(self.lone_surrogate());
                                }
                                self.pos += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return Err(self.lone_surrogate());
                                }
                                let cp = 0x10000
                                    + ((u32::from(hi) - 0xD800) << 10)
                                    + (u32::from(lo) - 0xDC00);
                                char::from_u32(cp)
                            } else if (0xDC00..0xE000).contains(&hi) {
                                None
                            } else {
                                char::from_u32(u32::from(hi))
                            };
                            match ch {
                                Some(ch) => out.push(ch),
                                None => return Err(self.lone_surrogate()),
                            }
                        }
                        _ => {
                            return Err(CanonError::Syntax {
                                offset: self.pos - 1,
                            })
                        }
                    }
                }
                _ => return Err(self.err()),
            }
        }
    }

    fn lone_surrogate(&self) -> CanonError {
        CanonError::LoneSurrogate
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// A number per RFC 8259, returned in canonical form.
    fn number(&mut self) -> Result<Cow<'a, str>, CanonError> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        let int_len = self.digits();
        if int_len == 0 || (int_len > 1 && self.s.get(int_start) == Some(&b'0')) {
            return Err(CanonError::Syntax { offset: int_start });
        }
        let mut frac = (self.pos, self.pos);
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let fs = self.pos;
            if self.digits() == 0 {
                return Err(self.err());
            }
            frac = (fs, self.pos);
        }
        let mut exp: i64 = 0;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            let mut exp_negative = false;
            match self.peek() {
                Some(b'-') => {
                    exp_negative = true;
                    self.pos += 1;
                }
                Some(b'+') => self.pos += 1,
                _ => {}
            }
            let es = self.pos;
            if self.digits() == 0 {
                return Err(self.err());
            }
            let exp_digits = self
                .text
                .get(es..self.pos)
                .unwrap_or("")
                .trim_start_matches('0');
            if exp_digits.len() > MAX_EXPONENT_DIGITS {
                return Err(CanonError::NumberOutOfRange);
            }
            exp = exp_digits.parse::<i64>().unwrap_or(0);
            if exp_negative {
                exp = -exp;
            }
        }
        let written = self.text.get(start..self.pos).unwrap_or("");
        // Fast path: an integer below 10^21 (and not -0) is its own canonical form.
        if frac.0 == frac.1 && self.pos == int_start + int_len && int_len <= 21 && written != "-0" {
            return Ok(Cow::Borrowed(written));
        }
        if written.parse::<f64>().map_or(true, |v| v.is_infinite()) {
            return Err(CanonError::NumberOutOfRange);
        }

        // Exact decimal: value = 0.DIGITS × 10^point, DIGITS without leading/trailing zeros.
        let int_digits = self.s.get(int_start..int_start + int_len).unwrap_or(b"");
        let frac_digits = self.s.get(frac.0..frac.1).unwrap_or(b"");
        let mut all: Vec<u8> = Vec::with_capacity(int_len + frac_digits.len());
        all.extend_from_slice(int_digits);
        all.extend_from_slice(frac_digits);
        let Some(first) = all.iter().position(|&d| d != b'0') else {
            return Ok(Cow::Borrowed("0")); // any zero, including -0 (as JCS)
        };
        let last = all.iter().rposition(|&d| d != b'0').unwrap_or(first);
        let digits = all.get(first..=last).unwrap_or(b"1");
        // Position of the decimal point relative to the first significant digit.
        let point = int_len as i64 - first as i64 + exp;
        Ok(Cow::Owned(format_es(negative, digits, point)))
    }
}

/// ECMAScript Number::toString layout for the decimal 0.`digits` × 10^`n` (digits non-empty,
/// no leading or trailing zeros): k = digits, n = exponent such that value = digits × 10^(n−k).
fn format_es(negative: bool, digits: &[u8], n: i64) -> String {
    let k = digits.len() as i64;
    let mut s = String::with_capacity(digits.len() + 8);
    if negative {
        s.push('-');
    }
    let d = |range: std::ops::Range<usize>| {
        digits
            .get(range)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let k_us = digits.len();
    if k <= n && n <= 21 {
        s.push_str(&d(0..k_us));
        for _ in 0..(n - k) {
            s.push('0');
        }
    } else if 0 < n && n <= 21 {
        let n_us = n as usize;
        s.push_str(&d(0..n_us));
        s.push('.');
        s.push_str(&d(n_us..k_us));
    } else if -6 < n && n <= 0 {
        s.push_str("0.");
        for _ in 0..(-n) {
            s.push('0');
        }
        s.push_str(&d(0..k_us));
    } else {
        let e = n - 1;
        s.push_str(&d(0..1));
        if k > 1 {
            s.push('.');
            s.push_str(&d(1..k_us));
        }
        s.push('e');
        s.push(if e < 0 { '-' } else { '+' });
        s.push_str(&e.unsigned_abs().to_string());
    }
    s
}

#[cfg(test)]
mod tests;
