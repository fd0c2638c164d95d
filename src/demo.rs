//! The built-in demo prompt: a synthetic warehouse ledger followed by a question about an early
//! entry. It is long enough for H2O to turn on by itself and to span several chunks at `-ub
//! 1024`, and answering it needs a token from far back — the case where keeping the right
//! memory matters.
//!
//! The text is generated deterministically by [`prompt`] (a small linear congruential
//! generator), so every run and every machine sees the same prompt.

const ITEMS: &[&str] = &[
    "copper gears",
    "glass lenses",
    "oak barrels",
    "wool blankets",
    "steel bolts",
    "paper maps",
    "clay pots",
    "silk scarves",
    "iron nails",
    "tin lanterns",
    "cotton sacks",
    "brass keys",
];
const PLACES: &[&str] = &[
    "the north dock",
    "the river gate",
    "the old mill",
    "the east yard",
    "the harbour office",
    "the hill depot",
    "the south pier",
    "the market hall",
];
const PEOPLE: &[&str] = &[
    "Ada", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ines", "Jonas",
];

struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// The demo prompt with `entries` ledger lines (the CLI uses [`DEFAULT_ENTRIES`]).
#[must_use]
pub fn prompt(entries: usize) -> String {
    let mut rng = Lcg(0x5eed_1234);
    let mut text = String::from(
        "Warehouse ledger. Each entry records a crate, what it holds, who moved it, and where it went.\n\n",
    );
    let mut asked = None;
    for i in 1..=entries {
        let item = ITEMS[rng.next(ITEMS.len())];
        let place = PLACES[rng.next(PLACES.len())];
        let person = PEOPLE[rng.next(PEOPLE.len())];
        let count = 2 + rng.next(97);
        let code = format!("{}-{}", (b'A' + rng.next(26) as u8) as char, 100 + i);
        text.push_str(&format!(
            "Entry {i}: crate {code} holds {count} {item}; {person} moved it to {place}.\n"
        ));
        if i == 3 {
            asked = Some((code, place, person));
        }
    }
    let (code, _, _) = asked.unwrap_or_else(|| ("A-101".into(), "", ""));
    text.push_str(&format!(
        "\nQuestion: Where did crate {code} go, and who moved it?\nAnswer: Crate {code} went to"
    ));
    text
}

/// Exactly `n_tokens` tokens of demo ledger (BOS first), for benchmarks that need a prompt of a
/// given length: the ledger is made long enough, tokenized, and cut.
///
/// # Errors
/// As [`Model::tokenize`](crate::Model::tokenize).
pub fn prompt_tokens(model: &crate::Model, n_tokens: usize) -> crate::Result<Vec<crate::Token>> {
    // an entry is 25-35 tokens: start a little above what is needed and grow if short
    let mut entries = n_tokens / 25 + 4;
    loop {
        let mut tokens = model.tokenize(&prompt(entries), true, true)?;
        if tokens.len() >= n_tokens {
            tokens.truncate(n_tokens);
            return Ok(tokens);
        }
        entries *= 2;
    }
}

/// Ledger entries in the CLI's demo prompt: about 4,700 tokens with the default model's
/// tokenizer, five chunks at `-ub 1024`: long enough for H2O to turn on by itself
/// ([`crate::H2oConfig::AUTO_FROM_TOKENS`]).
pub const DEFAULT_ENTRIES: usize = 160;

#[cfg(test)]
mod tests {
    #[test]
    fn prompt_is_deterministic_and_asks_about_an_early_entry() {
        let a = super::prompt(20);
        assert_eq!(a, super::prompt(20));
        assert!(a.contains("Entry 20:"));
        let code = a
            .lines()
            .find(|l| l.starts_with("Entry 3:"))
            .unwrap()
            .split_whitespace()
            .nth(3)
            .unwrap();
        assert!(a.ends_with(&format!("Crate {code} went to")));
    }
}
