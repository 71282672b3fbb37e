//! An HTTP(S) service named by a URL in the file: the upstream, a reconcile endpoint, a JWKS
//! origin, an external state API.

/// An HTTP(S) service the rendered Envoy talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

/// Why a URL does not name an HTTP(S) service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("{url:?} must start with http:// or https://")]
    Scheme { url: String },
    #[error("{url:?} must be scheme://host[:port], without a path, query or user")]
    NotAnOrigin { url: String },
    #[error("{url:?}: the port must be 1 to 65535")]
    Port { url: String },
    #[error("{url:?}: {host:?} is not a host name or address")]
    Host { url: String, host: String },
}

impl Endpoint {
    /// `http://host[:port]` or `https://host[:port]`, nothing after the authority.
    pub fn parse(url: &str) -> Result<Self, EndpointError> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("http://") {
            (false, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (true, r)
        } else {
            return Err(EndpointError::Scheme { url: url.into() });
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
            return Err(EndpointError::NotAnOrigin { url: url.into() });
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
                let port = p
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| EndpointError::Port { url: url.into() })?;
                (h, port)
            }
            _ => (authority, if tls { 443 } else { 80 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._:".contains(&b))
        {
            return Err(EndpointError::Host {
                url: url.into(),
                host: host.into(),
            });
        }
        Ok(Self {
            tls,
            host: host.to_owned(),
            port,
        })
    }

    /// The `:authority` for requests to it (the port only when it is not the scheme's).
    pub fn authority(&self) -> String {
        let default = if self.tls { 443 } else { 80 };
        if self.port == default {
            self.host.clone()
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}
