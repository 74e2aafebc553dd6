//! What the two fuzz tests share: how many cases to run and from which seed.

/// The number of cases: `var` from the environment, else 100,000.
pub fn cases(var: &str) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

/// The seed of one run: `PROPTEST_RNG_SEED` when set, else a fixed one (different per
/// `salt`) so that every run of the suite generates the same cases. Another seed
/// explores other cases; the run prints the one it used.
pub fn seed(salt: u64) -> u64 {
    std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x6f70_6d6f_6e00 ^ salt)
}
