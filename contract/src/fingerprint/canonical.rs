//! The canonical form of a JSON body (the module documentation of [`super`] says which):
//! read into a tree, members sorted by UTF-16 code units, written back in JCS's layout, with
//! what a [`Selection`] leaves out left out.

use super::{CanonError, Pointer, Selection, HEX, MAX_DEPTH, MAX_EXPONENT_DIGITS};
use crate::json::{self, Event};
use std::borrow::Cow;
use std::cmp::Ordering;

/// Strings and numbers borrow from the input when their canonical text is the text as written.
enum Node<'a> {
    Literal(&'static str),
    /// Canonical number text.
    Number(Cow<'a, str>),
    /// Decoded string value.
    Str(Cow<'a, str>),
    /// Its items in [`Tree::items`].
    Array(Span),
    /// Its members in [`Tree::members`], sorted by UTF-16 code units of the name.
    Object(Span),
}

/// Where a container's items or members are in the tree's shared lists: one list for every
/// container, not a `Vec` each (an allocation per container was a tenth of the cost).
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
}

/// A document read: its nodes, and every container's items and members, each container's
/// together.
#[derive(Default)]
struct Tree<'a> {
    nodes: Vec<Node<'a>>,
    items: Vec<usize>,
    members: Vec<(Cow<'a, str>, usize)>,
}

impl<'a> Tree<'a> {
    fn node(&self, i: usize) -> Option<&Node<'a>> {
        self.nodes.get(i)
    }

    fn items(&self, span: Span) -> &[usize] {
        self.items
            .get(span.start..span.start + span.len)
            .unwrap_or_default()
    }

    fn members(&self, span: Span) -> &[(Cow<'a, str>, usize)] {
        self.members
            .get(span.start..span.start + span.len)
            .unwrap_or_default()
    }

    fn push(&mut self, node: Node<'a>) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }
}

/// A container being read: where its items or members begin on the open lists, and for an
/// object the name of the next member.
enum Frame<'a> {
    Array {
        from: usize,
    },
    Object {
        from: usize,
        pending_name: Cow<'a, str>,
    },
}

/// The canonical form of a JSON text (see the module documentation), or why there is none.
pub fn canonicalize(input: &[u8]) -> Result<Vec<u8>, CanonError> {
    canonicalize_with(input, &Selection::Whole, None).map(|(c, _)| c)
}

/// The canonical form of what `selection` covers, and the string at `key_at` if asked.
pub(super) fn canonicalize_with(
    input: &[u8],
    selection: &Selection,
    key_at: Option<&Pointer>,
) -> Result<(Vec<u8>, Option<String>), CanonError> {
    let mut p = json::Parser::new(input, MAX_DEPTH).map_err(canon_error)?;
    // Sized from the input (a node takes at least 2 bytes of text, about 13 in an order's
    // body): fewer copies as they grow, at a transient cost of about twice the body.
    let mut tree = Tree {
        nodes: Vec::with_capacity(input.len() / 8 + 1),
        items: Vec::with_capacity(input.len() / 16 + 1),
        members: Vec::with_capacity(input.len() / 16 + 1),
    };
    let mut stack: Vec<Frame> = Vec::new();
    // The items and members of the containers still open, innermost last.
    let mut open_items: Vec<usize> = Vec::new();
    let mut open_members: Vec<(Cow<'_, str>, usize)> = Vec::new();
    // Reported once the whole document is known to be valid JSON.
    let mut duplicate: Option<String> = None;
    let root = loop {
        let event = p.next().map_err(canon_error)?;
        let done = match event {
            // Only after the document's value, which returned below.
            None => return Err(CanonError::Syntax { offset: p.offset() }),
            Some(Event::ObjectStart) => {
                stack.push(Frame::Object {
                    from: open_members.len(),
                    pending_name: Cow::Borrowed(""),
                });
                continue;
            }
            Some(Event::ArrayStart) => {
                stack.push(Frame::Array {
                    from: open_items.len(),
                });
                continue;
            }
            Some(Event::Name(name)) => {
                if let Some(Frame::Object { pending_name, .. }) = stack.last_mut() {
                    *pending_name = name;
                }
                continue;
            }
            Some(Event::ObjectEnd) => {
                let Some(Frame::Object { from, .. }) = stack.pop() else {
                    return Err(CanonError::Syntax { offset: p.offset() });
                };
                let members = open_members.get_mut(from..).unwrap_or_default();
                members.sort_unstable_by(|a, b| utf16_cmp(&a.0, &b.0));
                if duplicate.is_none() {
                    if let Some(w) = members.windows(2).find(|w| w[0].0 == w[1].0) {
                        duplicate = Some(w[0].0.to_string());
                    }
                }
                let span = Span {
                    start: tree.members.len(),
                    len: members.len(),
                };
                tree.members.extend(open_members.drain(from..));
                tree.push(Node::Object(span))
            }
            Some(Event::ArrayEnd) => {
                let Some(Frame::Array { from }) = stack.pop() else {
                    return Err(CanonError::Syntax { offset: p.offset() });
                };
                let span = Span {
                    start: tree.items.len(),
                    len: open_items.len().saturating_sub(from),
                };
                tree.items.extend(open_items.drain(from..));
                tree.push(Node::Array(span))
            }
            Some(Event::Str(s)) => tree.push(Node::Str(s)),
            Some(Event::Number(n)) => tree.push(Node::Number(canonical_number(n)?)),
            Some(Event::Bool(true)) => tree.push(Node::Literal("true")),
            Some(Event::Bool(false)) => tree.push(Node::Literal("false")),
            Some(Event::Null) => tree.push(Node::Literal("null")),
        };
        match stack.last_mut() {
            None => break done,
            Some(Frame::Array { .. }) => open_items.push(done),
            Some(Frame::Object { pending_name, .. }) => {
                open_members.push((std::mem::take(pending_name), done))
            }
        }
    };
    // Trailing text after the value makes the whole body invalid JSON.
    if p.next().map_err(canon_error)?.is_some() {
        return Err(CanonError::Syntax { offset: p.offset() });
    }
    if let Some(name) = duplicate {
        return Err(CanonError::DuplicateMember(name));
    }
    let key = key_at.and_then(|p| match resolve(&tree, root, p).last() {
        Some(&(_, _, child)) => match tree.node(child) {
            Some(Node::Str(s)) => Some(s.to_string()),
            _ => None,
        },
        None => None,
    });
    let filter = Filter::of(&tree, root, selection);
    Ok((serialize(&tree, root, input.len(), &filter), key))
}

/// The steps from the root to a pointer's target: (container, slot in it, child), all of them
/// when it resolves, none when it does not (a member or index missing, a scalar on the way).
fn resolve(tree: &Tree<'_>, root: usize, p: &Pointer) -> Vec<(usize, usize, usize)> {
    let mut steps = Vec::with_capacity(p.tokens.len());
    let mut at = root;
    for token in &p.tokens {
        let found = match tree.node(at) {
            Some(Node::Object(span)) => tree
                .members(*span)
                .iter()
                .enumerate()
                .find(|(_, (name, _))| name == token)
                .map(|(slot, (_, child))| (slot, *child)),
            Some(Node::Array(span)) => {
                index(token).and_then(|i| tree.items(*span).get(i).map(|child| (i, *child)))
            }
            _ => None,
        };
        let Some((slot, child)) = found else {
            return Vec::new();
        };
        steps.push((at, slot, child));
        at = child;
    }
    steps
}

/// An array index as RFC 6901 writes it: `0`, or digits without a leading zero.
fn index(token: &str) -> Option<usize> {
    let ok = token == "0"
        || (!token.is_empty()
            && !token.starts_with('0')
            && token.bytes().all(|b| b.is_ascii_digit()));
    ok.then(|| token.parse().ok()).flatten()
}

/// Which slots of which containers are written. Plain `Vec`s searched in order rather than
/// hash sets: a selection names a handful of members, and the filter's module stays smaller.
enum Filter {
    All,
    /// These (container, slot) pairs are left out.
    Skip(Vec<(usize, usize)>),
    /// Only these (container, slot) pairs are written in the containers on a path; the nodes
    /// in `whole` are written whole.
    Keep {
        on_path: Vec<(usize, usize)>,
        whole: Vec<usize>,
    },
}

/// Sorts and dedups a handful of items by insertion: `sort_unstable` would add a quicksort
/// instantiation (3 to 9 KiB) per item type to the filter's module.
pub(super) fn sort_dedup<T: PartialOrd>(v: &mut Vec<T>) {
    for i in 1..v.len() {
        let mut j = i;
        while j > 0 && v[j - 1] > v[j] {
            v.swap(j - 1, j);
            j -= 1;
        }
    }
    v.dedup();
}

impl Filter {
    fn of(tree: &Tree<'_>, root: usize, selection: &Selection) -> Self {
        match selection {
            Selection::Whole => Filter::All,
            Selection::Ignore(pointers) => Filter::Skip(
                pointers
                    .iter()
                    .filter_map(|p| resolve(tree, root, p).last().map(|&(c, s, _)| (c, s)))
                    .collect(),
            ),
            Selection::Include(pointers) => {
                let mut on_path = Vec::new();
                let mut whole = Vec::new();
                for p in pointers {
                    let steps = resolve(tree, root, p);
                    if let Some(&(_, _, target)) = steps.last() {
                        whole.push(target);
                        on_path.extend(steps.iter().map(|&(c, s, _)| (c, s)));
                    }
                }
                Filter::Keep { on_path, whole }
            }
        }
    }

    /// Whether slot `slot` of container `node` is written, given whether `node` is inside a
    /// subtree written whole.
    fn keeps(&self, node: usize, slot: usize, whole: bool) -> bool {
        match self {
            Filter::All => true,
            Filter::Skip(skip) => !skip.contains(&(node, slot)),
            Filter::Keep { on_path, .. } => whole || on_path.contains(&(node, slot)),
        }
    }

    /// Whether `child` is written whole (its parent's state carried down).
    fn whole(&self, child: usize, parent_whole: bool) -> bool {
        match self {
            Filter::Keep { whole, .. } => parent_whole || whole.contains(&child),
            _ => true,
        }
    }
}

fn canon_error(e: json::Error) -> CanonError {
    match e.kind {
        json::ErrorKind::LoneSurrogate => CanonError::LoneSurrogate,
        json::ErrorKind::TooDeep => CanonError::TooDeep,
        _ => CanonError::Syntax { offset: e.offset },
    }
}

/// Compares as sequences of UTF-16 code units (JCS member order), without transcoding: byte
/// order is code point order, and the two orders differ only where a supplementary character
/// (a surrogate pair in UTF-16) meets U+E000..U+FFFF, so only the first differing character is
/// looked at.
pub(super) fn utf16_cmp(a: &str, b: &str) -> Ordering {
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
    /// A node, and whether it is inside a subtree written whole.
    Node(usize, bool),
    Byte(u8),
    Name(&'a str),
}

fn serialize(tree: &Tree<'_>, root: usize, hint: usize, filter: &Filter) -> Vec<u8> {
    let mut out = Vec::with_capacity(hint);
    let mut work = vec![Work::Node(root, filter.whole(root, false))];
    while let Some(w) = work.pop() {
        match w {
            Work::Byte(b) => out.push(b),
            Work::Name(s) => write_string(&mut out, s),
            Work::Node(i, whole) => match tree.node(i) {
                Some(Node::Literal(l)) => out.extend_from_slice(l.as_bytes()),
                Some(Node::Number(n)) => out.extend_from_slice(n.as_bytes()),
                Some(Node::Str(s)) => write_string(&mut out, s),
                Some(Node::Array(span)) => {
                    work.push(Work::Byte(b']'));
                    // Pushed last first: the work stack pops them in order.
                    let mut later = false;
                    for (slot, item) in tree.items(*span).iter().enumerate().rev() {
                        if !filter.keeps(i, slot, whole) {
                            continue;
                        }
                        if later {
                            work.push(Work::Byte(b','));
                        }
                        work.push(Work::Node(*item, filter.whole(*item, whole)));
                        later = true;
                    }
                    out.push(b'[');
                }
                Some(Node::Object(span)) => {
                    work.push(Work::Byte(b'}'));
                    let mut later = false;
                    for (slot, (name, value)) in tree.members(*span).iter().enumerate().rev() {
                        if !filter.keeps(i, slot, whole) {
                            continue;
                        }
                        if later {
                            work.push(Work::Byte(b','));
                        }
                        work.push(Work::Node(*value, filter.whole(*value, whole)));
                        work.push(Work::Byte(b':'));
                        work.push(Work::Name(name));
                        later = true;
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
    let bytes = s.as_bytes();
    // Runs that need no escape are copied whole.
    let mut from = 0;
    for (at, &b) in bytes.iter().enumerate() {
        if b != b'"' && b != b'\\' && b >= 0x20 {
            continue;
        }
        out.extend_from_slice(bytes.get(from..at).unwrap_or_default());
        from = at + 1;
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
    out.extend_from_slice(bytes.get(from..).unwrap_or_default());
    out.push(b'"');
}

/// The canonical text of a number (valid RFC 8259 text, from the parser).
pub(super) fn canonical_number(written: &str) -> Result<Cow<'_, str>, CanonError> {
    let b = written.as_bytes();
    let negative = b.first() == Some(&b'-');
    let int_start = usize::from(negative);
    let int_len = b
        .iter()
        .skip(int_start)
        .take_while(|c| c.is_ascii_digit())
        .count();
    let mut at = int_start + int_len;
    let mut frac = (at, at);
    if b.get(at) == Some(&b'.') {
        let fs = at + 1;
        let len = b.iter().skip(fs).take_while(|c| c.is_ascii_digit()).count();
        frac = (fs, fs + len);
        at = fs + len;
    }
    let mut exp: i64 = 0;
    if matches!(b.get(at), Some(b'e' | b'E')) {
        let exp_text = written.get(at + 1..).unwrap_or("");
        let (exp_negative, exp_digits) = match exp_text.as_bytes().first() {
            Some(b'-') => (true, exp_text.get(1..).unwrap_or("")),
            Some(b'+') => (false, exp_text.get(1..).unwrap_or("")),
            _ => (false, exp_text),
        };
        let exp_digits = exp_digits.trim_start_matches('0');
        if exp_digits.len() > MAX_EXPONENT_DIGITS {
            return Err(CanonError::NumberOutOfRange);
        }
        exp = exp_digits.parse::<i64>().unwrap_or(0);
        if exp_negative {
            exp = -exp;
        }
        at = b.len();
    }
    // Fast path: an integer below 10^21 (and not -0) is its own canonical form.
    if frac.0 == frac.1 && at == int_start + int_len && int_len <= 21 && written != "-0" {
        return Ok(Cow::Borrowed(written));
    }
    // Fast path: a decimal written as `format_es` would write it (no exponent, no trailing
    // zero in the fraction; an integer part below 10^21, or `0.` and fewer than six zeros
    // before the first significant digit).
    if frac.0 < frac.1 && at == frac.1 && b.get(frac.1 - 1) != Some(&b'0') {
        let int_is_zero = int_len == 1 && b.get(int_start) == Some(&b'0');
        let plain = if int_is_zero {
            let fraction = b.get(frac.0..frac.1).unwrap_or_default();
            let zeros = fraction.iter().take_while(|&&d| d == b'0').count();
            zeros < 6
        } else {
            int_len <= 21
        };
        if plain {
            return Ok(Cow::Borrowed(written));
        }
    }
    // Exact decimal: value = 0.DIGITS × 10^point, DIGITS without leading/trailing zeros.
    let int_digits = b.get(int_start..int_start + int_len).unwrap_or(b"");
    let frac_digits = b.get(frac.0..frac.1).unwrap_or(b"");
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
    if beyond_double(digits, point) {
        return Err(CanonError::NumberOutOfRange);
    }
    Ok(Cow::Owned(format_es(negative, digits, point)))
}

/// 2^1024 − 2^970, the smallest magnitude a double rounds to infinity, as 0.DIGITS × 10^309.
pub(super) const DOUBLE_OVERFLOW: &[u8] = b"179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792";

/// Whether 0.`digits` × 10^`point` is beyond a double's range (what `str::parse::<f64>` reads
/// as infinite), decided on the decimal digits: no float parsing in the module.
fn beyond_double(digits: &[u8], point: i64) -> bool {
    match point.cmp(&309) {
        std::cmp::Ordering::Less => false,
        std::cmp::Ordering::Greater => true,
        // Both without trailing zeros: a digit string compares as the fraction it spells.
        std::cmp::Ordering::Equal => digits >= DOUBLE_OVERFLOW,
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
