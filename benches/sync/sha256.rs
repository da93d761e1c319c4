//! SHA-256 (FIPS 180-4), small and unhurried: upstream kube-proxy names its chains after a SHA-256 hash,
//! and the anchors must carry the same names. The bench hashes a few short names per service, so clarity
//! beats speed here, and a crate for it would be one more dependency for a benchmark.

/// The first 32 bits of the fractional parts of the cube roots of the first 64 primes.
const ROUND_CONSTANTS: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// The first 32 bits of the fractional parts of the square roots of the first 8 primes.
const INITIAL_STATE: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

const BLOCK_BYTES: usize = 64;

/// The SHA-256 digest of `message`.
pub fn digest(message: &[u8]) -> [u8; 32] {
    let mut state = INITIAL_STATE;
    for block in padded(message).chunks_exact(BLOCK_BYTES) {
        compress(&mut state, block);
    }
    let mut out = [0u8; 32];
    for (bytes, word) in out.chunks_exact_mut(4).zip(state) {
        bytes.copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// The message, a 1 bit, zeros, and the message's length in bits (64-bit big-endian), filling whole blocks.
fn padded(message: &[u8]) -> Vec<u8> {
    let bit_length = (message.len() as u64) * 8;
    let mut data = message.to_vec();
    data.push(0x80);
    while data.len() % BLOCK_BYTES != BLOCK_BYTES - 8 {
        data.push(0);
    }
    data.extend_from_slice(&bit_length.to_be_bytes());
    data
}

/// One block's 64 rounds, added into the running state.
fn compress(state: &mut [u32; 8], block: &[u8]) {
    let mut working = *state;
    for (constant, word) in ROUND_CONSTANTS.iter().zip(message_schedule(block)) {
        let [a, b, c, d, e, f, g, h] = working;
        let choose = (e & f) ^ (!e & g);
        let majority = (a & b) ^ (a & c) ^ (b & c);
        let sigma_e = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let sigma_a = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let t1 = h
            .wrapping_add(sigma_e)
            .wrapping_add(choose)
            .wrapping_add(*constant)
            .wrapping_add(word);
        let t2 = sigma_a.wrapping_add(majority);
        working = [t1.wrapping_add(t2), a, b, c, d.wrapping_add(t1), e, f, g];
    }
    for (word, add) in state.iter_mut().zip(working) {
        *word = word.wrapping_add(add);
    }
}

/// The block's sixteen big-endian words, extended to one word per round.
fn message_schedule(block: &[u8]) -> [u32; 64] {
    let mut w = [0u32; 64];
    for (word, bytes) in w.iter_mut().zip(block.chunks_exact(4)) {
        *word = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16]
            .wrapping_add(s0)
            .wrapping_add(w[i - 7])
            .wrapping_add(s1);
    }
    w
}

/// Fails loudly if the digest is wrong: FIPS 180-2's test vectors, one block and two blocks long.
pub fn self_check() {
    let vectors: [(&[u8], &str); 2] = [
        (
            b"abc",
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
        ),
        (
            b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        ),
    ];
    for (message, expected) in vectors {
        let hex: String = digest(message).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            expected,
            "SHA-256 of {:?}",
            String::from_utf8_lossy(message)
        );
    }
}
