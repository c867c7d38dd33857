//! Any bytes: decoding a handshake never panics; whatever decodes re-encodes
//! to the same bytes and can be checked for compatibility.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_bounce::proto::wire::Handshake;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Handshake::decode(data) {
        assert_eq!(h.encode(), data, "decode/encode is not a bijection");
        let _ = h.check_compatible(&h);
    }
});
