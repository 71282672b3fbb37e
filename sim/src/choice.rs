//! Where every decision of a schedule comes from: a seeded generator, or a list of choices
//! replayed (to reproduce a run, and to shrink a failing one). A run is a pure function of the
//! choices it takes, so the same seed replays the same run.

/// SplitMix64: small, fast, and the same on every machine.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Debug, Clone)]
pub struct Choices {
    source: Source,
    /// Every choice taken so far, in order (what a replay needs).
    pub taken: Vec<u32>,
}

#[derive(Debug, Clone)]
enum Source {
    Seeded(SplitMix),
    /// Choices past the end of the list are 0, the smallest of each.
    Replayed {
        list: Vec<u32>,
        at: usize,
    },
}

impl Choices {
    pub fn seeded(seed: u64) -> Self {
        Self {
            source: Source::Seeded(SplitMix(seed)),
            taken: Vec::new(),
        }
    }

    pub fn replay(list: Vec<u32>) -> Self {
        Self {
            source: Source::Replayed { list, at: 0 },
            taken: Vec::new(),
        }
    }

    /// A number in `0..n` (`n` at least 1).
    pub fn below(&mut self, n: u32) -> u32 {
        let n = n.max(1);
        let v = match &mut self.source {
            Source::Seeded(r) => (r.next() % u64::from(n)) as u32,
            Source::Replayed { list, at } => {
                let v = list.get(*at).copied().unwrap_or(0) % n;
                *at += 1;
                v
            }
        };
        self.taken.push(v);
        v
    }

    /// True `percent` times in a hundred (a replayed 0 is false: shrinking removes events).
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) >= 100 - percent.min(100)
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        let i = self.below(u32::try_from(items.len()).unwrap_or(u32::MAX)) as usize;
        &items[i.min(items.len() - 1)]
    }

    /// An index into weighted alternatives.
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u32 = weights.iter().sum();
        let mut x = self.below(total.max(1));
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        0
    }
}
