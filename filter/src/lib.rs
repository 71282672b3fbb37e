//! The proxy-wasm filter. (Being built: see issue 3.)
