//! Data loading: windows, seeded epoch order, and the split of a global batch across ranks and
//! micro-batches.

use std::collections::BTreeSet;

use zerodp::data::{Corpus, DataError, DataLoader};

/// A text whose windows are easy to tell apart.
fn text(len: usize) -> String {
    (0..len)
        .map(|i| char::from(b'a' + ((i * 7 + i / 26) % 26) as u8))
        .collect()
}

#[test]
fn windows_are_consecutive_and_targets_shift_by_one() {
    let context = 8;
    let t = text(9 * 10 + 5);
    let loader = DataLoader::new(Corpus::from_text("t", &t), context, 0).unwrap();
    assert_eq!(loader.num_windows(), 10);
    let b = loader.micro_batch(0, 10, 1, 0, 10, 0).unwrap();
    assert_eq!((b.batch_size, b.seq_len), (10, context));
    for row in 0..10 {
        let toks = &b.tokens[row * context..(row + 1) * context];
        let tgts = &b.targets[row * context..(row + 1) * context];
        let w = loader.window_of_sample(row as u64);
        let window = &t.as_bytes()[w * 9..w * 9 + 9];
        assert!(toks
            .iter()
            .zip(&window[..8])
            .all(|(&a, &b)| a == u32::from(b)));
        assert!(tgts
            .iter()
            .zip(&window[1..])
            .all(|(&a, &b)| a == u32::from(b)));
    }
}

#[test]
fn every_epoch_visits_every_window_once_in_a_seeded_order() {
    let loader = DataLoader::new(Corpus::from_text("t", &text(17 * 50)), 16, 7).unwrap();
    let w = loader.num_windows() as u64;
    assert_eq!(w, 50);
    let epoch = |e: u64| -> Vec<usize> {
        (e * w..(e + 1) * w)
            .map(|g| loader.window_of_sample(g))
            .collect()
    };
    let all: BTreeSet<usize> = (0..50).collect();
    for e in 0..3 {
        let order = epoch(e);
        assert_eq!(order.iter().copied().collect::<BTreeSet<_>>(), all);
        assert_eq!(order.len(), 50);
    }
    assert_ne!(epoch(0), epoch(1), "each epoch has its own order");
    assert_ne!(
        epoch(0),
        (0..50).collect::<Vec<_>>(),
        "the order is shuffled"
    );
    // Same seed, another loader object: same order; another seed: another order.
    let same = DataLoader::new(Corpus::from_text("t", &text(17 * 50)), 16, 7).unwrap();
    let other = DataLoader::new(Corpus::from_text("t", &text(17 * 50)), 16, 8).unwrap();
    assert_eq!(*same.epoch_order(1), *loader.epoch_order(1));
    assert_ne!(*other.epoch_order(0), *loader.epoch_order(0));
}

#[test]
fn a_step_is_the_same_global_batch_whatever_the_split() {
    // 23 windows and a batch of 12: steps straddle epoch boundaries too.
    let loader = DataLoader::new(Corpus::from_text("t", &text(9 * 23)), 8, 3).unwrap();
    let global_batch = 12;
    for step in 0..5 {
        let reference = loader
            .micro_batch(step, global_batch, 1, 0, global_batch, 0)
            .unwrap();
        for world in [1usize, 2, 3, 4] {
            let per_rank = global_batch / world;
            for micro in (1..=per_rank).filter(|m| per_rank % m == 0) {
                let mut tokens = Vec::new();
                let mut targets = Vec::new();
                for rank in 0..world {
                    for m in 0..per_rank / micro {
                        let b = loader
                            .micro_batch(step, global_batch, world, rank, micro, m)
                            .unwrap();
                        assert_eq!(b.batch_size, micro);
                        tokens.extend(b.tokens);
                        targets.extend(b.targets);
                    }
                }
                assert_eq!(
                    tokens, reference.tokens,
                    "step {step}, world {world}, micro {micro}"
                );
                assert_eq!(targets, reference.targets);
            }
        }
    }
    // Consecutive steps continue the stream.
    let two = loader.micro_batch(0, 24, 1, 0, 24, 0).unwrap();
    let first = loader.micro_batch(0, 12, 1, 0, 12, 0).unwrap();
    let second = loader.micro_batch(1, 12, 1, 0, 12, 0).unwrap();
    assert_eq!(two.tokens, [first.tokens, second.tokens].concat());
}

#[test]
fn bad_inputs_are_reported_with_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.txt");
    let err = Corpus::from_file(&missing).unwrap_err().to_string();
    assert!(err.contains("nope.txt"), "{err}");

    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let err = Corpus::from_file(&latin1).unwrap_err();
    assert!(matches!(err, DataError::NotUtf8 { offset: 3, .. }), "{err}");
    assert!(err.to_string().contains("latin1.txt"));

    let short = dir.path().join("short.txt");
    std::fs::write(&short, "tiny").unwrap();
    let corpus = Corpus::from_file(&short).unwrap();
    assert_eq!(corpus.len(), 4);
    let err = DataLoader::new(corpus, 4, 0).unwrap_err().to_string();
    assert!(
        err.contains("short.txt") && err.contains("context"),
        "{err}"
    );

    let loader = DataLoader::new(Corpus::from_text("t", &text(100)), 4, 0).unwrap();
    assert!(
        loader.micro_batch(0, 8, 2, 2, 4, 0).is_err(),
        "rank outside the world"
    );
    assert!(
        loader.micro_batch(0, 8, 2, 1, 4, 1).is_err(),
        "micro-batch past the rank's share"
    );
}
