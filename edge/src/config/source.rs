//! What every section's reader shares: the file's text (for the line of an error), the lines
//! of the fields a later error names, and the shapes of a token, a header name and an address.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use toml::Spanned;

use super::ConfigError;

/// Turns byte offsets into line numbers, and errors into [`ConfigError::At`].
pub(super) struct Source<'a> {
    pub(super) file: &'a str,
    pub(super) text: &'a str,
}

impl Source<'_> {
    pub(super) fn line(&self, offset: usize) -> usize {
        1 + self
            .text
            .get(..offset.min(self.text.len()))
            .unwrap_or("")
            .bytes()
            .filter(|b| *b == b'\n')
            .count()
    }

    pub(super) fn at<T>(
        &self,
        span: std::ops::Range<usize>,
        message: impl Into<String>,
    ) -> Result<T, ConfigError> {
        Err(ConfigError::At {
            file: self.file.to_owned(),
            line: self.line(span.start),
            message: message.into(),
        })
    }
}

pub(super) fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

pub(super) fn is_header_name(s: &str) -> bool {
    is_token(s) && !s.starts_with(':')
}

/// The lines of the fields a later error may name (a port in use: [`Config::error_at`]).
#[derive(Default)]
pub(super) struct Lines(pub(super) BTreeMap<String, usize>);

impl Lines {
    pub(super) fn note(&mut self, src: &Source<'_>, name: &str, span: std::ops::Range<usize>) {
        self.0.insert(name.to_owned(), src.line(span.start));
    }
}

/// An address and port (`listen`, `admin`, `state.listen`).
pub(super) fn socket(
    src: &Source<'_>,
    v: &Spanned<String>,
    name: &str,
) -> Result<SocketAddr, ConfigError> {
    v.get_ref().parse::<SocketAddr>().or_else(|_| {
        src.at(
            v.span(),
            format!(
                "{name} must be an address and port like 127.0.0.1:10000, not {:?}",
                v.get_ref()
            ),
        )
    })
}
