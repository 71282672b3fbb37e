//! Objects by field: [`Fields`] takes an object apart with errors that name the field.

use super::tree::Value;

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
