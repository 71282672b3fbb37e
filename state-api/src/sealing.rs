//! Stored responses encrypted at rest: a copy of the table reveals neither keys (those are
//! HMAC addresses already) nor responses (status aside).
//!
//! Each completed record's headers and body are sealed together with AES-256-GCM under a key
//! of its own, derived with HKDF-SHA256 from the storage key and the record's address and
//! fencing token, with a random 96-bit nonce: a ciphertext moved to another record (or kept
//! from an older owner of the same key) does not open there, so a tampered table answers 500,
//! never a wrong replay, and the random nonces never meet under one derived key (a record is
//! sealed a handful of times at most: its complete, an operator's resolve). The record keeps
//! the storage key's id, so a rotated key still opens what the previous one sealed.

use std::borrow::Cow;

use aes_gcm::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use base64::Engine as _;
use hkdf::Hkdf;
use secrecy::{ExposeSecret, SecretBox};
use sha2::{Digest, Sha256};

use contract::wire::StoredResponse;

const NONCE_LEN: usize = 12;
const DERIVE_INFO: &[u8] = b"idempotency-stored-response-v1";
const KEY_ID_CONTEXT: &[u8] = b"idempotency-storage-key-id-v1";

/// One AES-256 storage key and its id (derived from it, stored with every record it seals).
pub struct StorageKey {
    id: i64,
    key: SecretBox<[u8; 32]>,
}

impl std::fmt::Debug for StorageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StorageKey(id {})", self.id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("a storage key is 32 bytes in standard base64 (`openssl rand -base64 32`)")]
    Malformed,
    #[error("cannot read the storage key file {0}: {1}")]
    Unreadable(String, String),
}

impl StorageKey {
    /// From its standard base64 text (surrounding whitespace ignored, as in a key file).
    pub fn from_base64(text: &str) -> Result<Self, KeyError> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|_| KeyError::Malformed)?;
        let key: [u8; 32] = bytes.try_into().map_err(|_| KeyError::Malformed)?;
        let digest = Sha256::new()
            .chain_update(KEY_ID_CONTEXT)
            .chain_update(key)
            .finalize();
        let mut id = [0u8; 8];
        id.copy_from_slice(&digest[..8]);
        Ok(Self {
            id: i64::from_be_bytes(id),
            key: SecretBox::new(Box::new(key)),
        })
    }

    pub fn from_file(path: &std::path::Path) -> Result<Self, KeyError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| KeyError::Unreadable(path.display().to_string(), e.to_string()))?;
        Self::from_base64(&text)
    }

    pub fn id(&self) -> i64 {
        self.id
    }

    /// The record's own key: bound to its address and its owner's fencing token.
    fn cipher_for(&self, scope: &[u8], token: i64) -> Aes256Gcm {
        let hk = Hkdf::<Sha256>::new(None, self.key.expose_secret());
        let mut okm = [0u8; 32];
        let info = [DERIVE_INFO, scope, &token.to_be_bytes()];
        // 32 bytes is far below HKDF-SHA256's limit (255 * 32): this cannot fail.
        let _ = hk.expand_multi_info(&info, &mut okm);
        let cipher = Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(&okm));
        okm.fill(0);
        cipher
    }
}

/// A response as written to the record's columns (in clear, it borrows the response: no copy
/// of the body on the way to the database).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed<'a> {
    /// The storage key's id; `None`: written in clear (no storage key configured).
    pub key_id: Option<i64>,
    /// In clear without a storage key; empty when sealed (they are in `body`).
    pub headers: Cow<'a, [(String, String)]>,
    /// The body in clear, or nonce || AES-GCM(headers and body) || tag.
    pub body: Cow<'a, [u8]>,
}

impl Sealed<'static> {
    /// The columns of a stored record, as read.
    pub fn read(key_id: Option<i64>, headers: Vec<(String, String)>, body: Vec<u8>) -> Self {
        Self {
            key_id,
            headers: Cow::Owned(headers),
            body: Cow::Owned(body),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    #[error("sealed under storage key {0}, which this state API does not have (--storage-key, --previous-storage-key)")]
    UnknownKey(i64),
    #[error("the stored response does not open under its storage key: altered, or moved from another record")]
    Tampered,
}

/// The storage keys of this process: the current one seals, both open.
#[derive(Debug, Default)]
pub struct Sealer {
    current: Option<StorageKey>,
    previous: Option<StorageKey>,
}

impl Sealer {
    pub fn new(current: Option<StorageKey>, previous: Option<StorageKey>) -> Self {
        Self { current, previous }
    }

    /// Whether new records are sealed.
    pub fn seals(&self) -> bool {
        self.current.is_some()
    }

    pub fn seal<'a>(&self, scope: &[u8], token: i64, response: &'a StoredResponse) -> Sealed<'a> {
        let Some(key) = &self.current else {
            return Sealed {
                key_id: None,
                headers: Cow::Borrowed(&response.headers),
                body: Cow::Borrowed(&response.body),
            };
        };
        let headers = serde_json::to_vec(&response.headers).unwrap_or_default();
        let mut plain = Vec::with_capacity(4 + headers.len() + response.body.len());
        plain.extend_from_slice(
            &u32::try_from(headers.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        plain.extend_from_slice(&headers);
        plain.extend_from_slice(&response.body);
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let aad = aad(response.status, response.replayable);
        let sealed = key
            .cipher_for(scope, token)
            .encrypt(
                &nonce,
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .unwrap_or_default();
        plain.fill(0);
        let mut body = Vec::with_capacity(NONCE_LEN + sealed.len());
        body.extend_from_slice(&nonce);
        body.extend_from_slice(&sealed);
        Sealed {
            key_id: Some(key.id),
            headers: Cow::Borrowed(&[]),
            body: Cow::Owned(body),
        }
    }

    /// The stored response of the record at `scope` owned by `token`, as it was completed.
    pub fn open(
        &self,
        scope: &[u8],
        token: i64,
        status: u16,
        replayable: bool,
        stored: Sealed<'_>,
    ) -> Result<StoredResponse, OpenError> {
        let Some(id) = stored.key_id else {
            return Ok(StoredResponse {
                status,
                headers: stored.headers.into_owned(),
                body: stored.body.into_owned(),
                replayable,
            });
        };
        let key = [&self.current, &self.previous]
            .into_iter()
            .flatten()
            .find(|k| k.id == id)
            .ok_or(OpenError::UnknownKey(id))?;
        if stored.body.len() < NONCE_LEN {
            return Err(OpenError::Tampered);
        }
        let (nonce, sealed) = stored.body.split_at(NONCE_LEN);
        let plain = key
            .cipher_for(scope, token)
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: &aad(status, replayable),
                },
            )
            .map_err(|_| OpenError::Tampered)?;
        let (len, rest) = plain.split_at_checked(4).ok_or(OpenError::Tampered)?;
        let len = u32::from_be_bytes(len.try_into().map_err(|_| OpenError::Tampered)?);
        let (headers, body) = rest
            .split_at_checked(usize::try_from(len).map_err(|_| OpenError::Tampered)?)
            .ok_or(OpenError::Tampered)?;
        Ok(StoredResponse {
            status,
            headers: serde_json::from_slice(headers).map_err(|_| OpenError::Tampered)?,
            body: body.to_vec(),
            replayable,
        })
    }
}

/// What stays in clear beside the ciphertext is authenticated with it: a status or a
/// replayable flag changed in the table does not open either.
fn aad(status: u16, replayable: bool) -> [u8; 3] {
    let [hi, lo] = status.to_be_bytes();
    [hi, lo, u8::from(replayable)]
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn key(byte: u8) -> StorageKey {
        StorageKey::from_base64(&base64::engine::general_purpose::STANDARD.encode([byte; 32]))
            .unwrap()
    }

    fn response() -> StoredResponse {
        StoredResponse::new(
            201,
            vec![("location".into(), "/charges/ch_secret".into())],
            b"{\"card\":\"4242\"}",
            true,
        )
    }

    fn open(
        s: &Sealer,
        scope: &[u8],
        token: i64,
        sealed: Sealed<'_>,
    ) -> Result<StoredResponse, OpenError> {
        s.open(scope, token, 201, true, sealed)
    }

    #[test]
    fn sealed_responses_open_only_where_they_were_sealed() {
        let s = Sealer::new(Some(key(1)), None);
        let marked = response();
        let sealed = s.seal(&[7; 32], 42, &marked);
        assert!(sealed.headers.is_empty());
        let text = String::from_utf8_lossy(&sealed.body);
        assert!(
            !text.contains("4242") && !text.contains("ch_secret"),
            "{text}"
        );
        assert_eq!(open(&s, &[7; 32], 42, sealed.clone()), Ok(response()));
        // Another record, another owner's token, a flipped bit, another status: no.
        assert_eq!(
            open(&s, &[8; 32], 42, sealed.clone()),
            Err(OpenError::Tampered)
        );
        assert_eq!(
            open(&s, &[7; 32], 43, sealed.clone()),
            Err(OpenError::Tampered)
        );
        let mut flipped = sealed.clone();
        let last = flipped.body.len() - 1;
        flipped.body.to_mut()[last] ^= 1;
        assert_eq!(open(&s, &[7; 32], 42, flipped), Err(OpenError::Tampered));
        assert_eq!(
            s.open(&[7; 32], 42, 200, true, sealed.clone()),
            Err(OpenError::Tampered)
        );
        // Two seals of the same response differ (random nonce).
        assert_ne!(s.seal(&[7; 32], 42, &marked).body, sealed.body);
    }

    #[test]
    fn a_rotated_key_still_opens_what_the_previous_one_sealed() {
        let old = Sealer::new(Some(key(1)), None);
        let marked = response();
        let sealed = old.seal(&[7; 32], 42, &marked);
        let rotated = Sealer::new(Some(key(2)), Some(key(1)));
        assert_eq!(open(&rotated, &[7; 32], 42, sealed.clone()), Ok(response()));
        assert_eq!(
            rotated.seal(&[7; 32], 42, &response()).key_id,
            Some(key(2).id())
        );
        let forgotten = Sealer::new(Some(key(2)), None);
        assert_eq!(
            open(&forgotten, &[7; 32], 42, sealed),
            Err(OpenError::UnknownKey(key(1).id()))
        );
    }

    #[test]
    fn without_a_storage_key_responses_are_kept_in_clear() {
        let s = Sealer::default();
        let marked = response();
        let sealed = s.seal(&[7; 32], 42, &marked);
        assert_eq!(sealed.key_id, None);
        assert_eq!(&sealed.body[..], &response().body[..]);
        assert_eq!(open(&s, &[7; 32], 42, sealed), Ok(response()));
    }

    #[test]
    fn keys_must_be_32_bytes_of_base64() {
        assert_eq!(
            StorageKey::from_base64("c2hvcnQ=").err(),
            Some(KeyError::Malformed)
        );
        assert_eq!(
            StorageKey::from_base64("!!").err(),
            Some(KeyError::Malformed)
        );
        assert_ne!(key(1).id(), key(2).id());
    }
}
