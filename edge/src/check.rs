//! A configuration file checked whole: each field as `config.rs` reads it, then what only the
//! whole shows: the plugin configuration it renders (`render.rs`) must be one the filter's own
//! reader accepts, and no two listeners may share an address.

use std::net::SocketAddr;
use std::path::Path;

use filter_core::config as fc;

use crate::config::{Config, ConfigError};
use crate::render::filter_json;

impl Config {
    /// Reads and checks a file; relative paths in it are read against its folder.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            file: file.clone(),
            message: format!("cannot read it: {e}"),
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&text, &file, &base)
    }

    /// Parses and checks the text of a file named `file`, in folder `base`.
    pub fn parse(text: &str, file: &str, base: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::read(text, file, base)?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Checks what the filter would refuse (the rendered plugin configuration, parsed by the
    /// filter's own code) and what the addresses must not share.
    pub fn check(&self) -> Result<(), ConfigError> {
        let json = filter_json(self, "check-only-token");
        fc::Config::parse(json.as_bytes())?;
        let mut used: Vec<(&str, SocketAddr)> =
            vec![("listen", self.listen), ("state.listen", self.state.listen)];
        if let Some(a) = self.admin {
            used.push(("admin", a));
        }
        for (i, (a, x)) in used.iter().enumerate() {
            if let Some((b, _)) = used[..i].iter().find(|(_, y)| {
                y.port() == x.port()
                    && (y.ip() == x.ip() || y.ip().is_unspecified() || x.ip().is_unspecified())
            }) {
                return Err(self.error_at(a, format!("{a} ({x}) is the same address as {b}")));
            }
        }
        Ok(())
    }
}
