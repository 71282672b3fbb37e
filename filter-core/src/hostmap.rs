//! The proxy-wasm header map encoding (host calls exchange header lists in it).

/// proxy-wasm map encoding: count, (key length, value length) pairs, then each key and value
/// followed by a NUL.
pub fn serialize_map(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

pub fn deserialize_map(bytes: &[u8]) -> Option<Vec<(String, String)>> {
    let u32_at = |at: usize| -> Option<usize> {
        let b: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    let n = u32_at(0)?;
    let mut sizes = Vec::with_capacity(n.min(1024));
    for i in 0..n {
        sizes.push((u32_at(4 + i * 8)?, u32_at(8 + i * 8)?));
    }
    let mut at = 4 + n * 8;
    let mut out = Vec::with_capacity(sizes.len());
    for (ks, vs) in sizes {
        let k = bytes.get(at..at.checked_add(ks)?)?;
        at += ks + 1;
        let v = bytes.get(at..at.checked_add(vs)?)?;
        at += vs + 1;
        out.push((
            String::from_utf8_lossy(k).into_owned(),
            String::from_utf8_lossy(v).into_owned(),
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trips_and_rejects_truncation() {
        let pairs = vec![
            (":status".to_owned(), "200".to_owned()),
            ("a".to_owned(), String::new()),
            ("a".to_owned(), "x y".to_owned()),
        ];
        let bytes = serialize_map(&pairs);
        assert_eq!(deserialize_map(&bytes), Some(pairs));
        for cut in 0..bytes.len() - 1 {
            let _ = deserialize_map(&bytes[..cut]); // never panics
        }
        assert_eq!(deserialize_map(&bytes[..10]), None);
        assert_eq!(deserialize_map(&[0, 0, 0, 0]), Some(vec![]));
        assert_eq!(deserialize_map(&[255, 255, 255, 255]), None);
    }
}
