//! Any bytes: decoding never panics; whatever decodes re-encodes to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nixl_bounce::proto::wire::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = Message::decode(data) {
        assert_eq!(msg.encode(), data, "decode/encode is not a bijection");
    }
});
