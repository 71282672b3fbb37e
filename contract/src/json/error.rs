//! What is wrong with a document, and where.

use std::fmt;

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
    pub(super) fn at(kind: ErrorKind, s: &[u8], offset: usize) -> Self {
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
