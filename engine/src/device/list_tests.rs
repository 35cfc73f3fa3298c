//! Tests of the device grammar: every form, every problem, and `Display` reading back.
use super::*;

fn ids(text: &str) -> Vec<String> {
    match text.parse::<DeviceList>() {
        Ok(list) => list.0.iter().map(ToString::to_string).collect(),
        Err(e) => panic!("`{text}` should parse: {e}"),
    }
}

/// The problem and item of a text that must not parse as a list.
fn problem(text: &str) -> (Option<usize>, DeviceListProblem) {
    match text.parse::<DeviceList>() {
        Err(Error::InvalidDeviceList { text: given, item_idx, problem }) => {
            assert_eq!(given, text);
            (item_idx, problem)
        }
        other => panic!("`{text}` should be refused as a device list, got {other:?}"),
    }
}

#[test]
fn every_form_of_the_grammar() {
    // The CLI's shorthand: a lone cpu:N is N CPU devices.
    assert_eq!(ids("cpu:4"), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]);
    assert_eq!(ids("cpu:1"), ["cpu:0"]);
    // Ranges, single devices, lists, kinds carried over to bare ordinals.
    assert_eq!(ids("cpu:0-3"), ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]);
    assert_eq!(ids("cpu:2-2"), ["cpu:2"]);
    assert_eq!(ids("cuda:1"), ["cuda:1"]);
    assert_eq!(ids("cuda:0,1"), ["cuda:0", "cuda:1"]);
    assert_eq!(ids("cpu:0,cuda:0"), ["cpu:0", "cuda:0"]);
    assert_eq!(ids("cpu:0,cpu:1"), ["cpu:0", "cpu:1"]);
    assert_eq!(ids("cpu:4,1"), ["cpu:4", "cpu:1"]);
    assert_eq!(ids("cpu:0-1,cuda:0,2-3"), ["cpu:0", "cpu:1", "cuda:0", "cuda:2", "cuda:3"]);
    assert_eq!(ids(" cpu : 1 - 2 , cuda:0 "), ["cpu:1", "cpu:2", "cuda:0"]);
    // The limit itself is accepted.
    assert_eq!(ids(&format!("cpu:{MAX_DEVICES}")).len(), MAX_DEVICES);
    assert_eq!(ids(&format!("cuda:0-{}", MAX_DEVICES - 1)).len(), MAX_DEVICES);
    // One device: no shorthand.
    assert_eq!("cpu:3".parse::<DeviceId>().unwrap(), DeviceId::cpu(3));
    assert_eq!("cuda:1".parse::<DeviceId>().unwrap(), DeviceId::cuda(1));
    assert_eq!(Device::parse("cpu:3").unwrap().to_string(), "cpu:3");
    assert_eq!(Device::parse("cpu:3").unwrap().id(), Some(DeviceId::cpu(3)));
    assert_eq!(Device::host().id(), None);
}

#[test]
fn budgets_reach_every_device() {
    let devices = Device::parse_list_with_budget("cpu:0-2", Some(1 << 20)).unwrap();
    assert_eq!(devices.len(), 3);
    assert!(devices.iter().all(|d| d.memory_budget() == Some(1 << 20)));
    assert_eq!(Device::parse_with_budget("cpu:5", Some(7)).unwrap().memory_budget(), Some(7));
    assert_eq!(Device::parse_list("cpu:2").unwrap()[1].memory_budget(), None);
}

#[test]
fn every_problem_is_named_with_its_item() {
    use DeviceListProblem as P;
    assert_eq!(problem(""), (None, P::Empty));
    assert_eq!(problem("  "), (None, P::Empty));
    assert_eq!(problem("cpu:0,,cpu:1"), (Some(1), P::EmptyItem));
    assert_eq!(problem("cpu:0,"), (Some(1), P::EmptyItem));
    assert_eq!(problem("0,1"), (Some(0), P::MissingKind { text: "0".into() }));
    assert_eq!(problem("cpu"), (Some(0), P::MissingKind { text: "cpu".into() }));
    assert_eq!(problem("gpu:2"), (Some(0), P::UnknownKind { kind: "gpu".into() }));
    assert_eq!(problem("cpu:0,tpu:1"), (Some(1), P::UnknownKind { kind: "tpu".into() }));
    assert_eq!(problem("cuda:x"), (Some(0), P::BadOrdinal { text: "x".into() }));
    assert_eq!(problem("cpu:0,cpu:-1"), (Some(1), P::BadOrdinal { text: "".into() }));
    assert_eq!(problem("cuda:1-"), (Some(0), P::BadOrdinal { text: "".into() }));
    assert_eq!(problem("cuda:0,1.5"), (Some(1), P::BadOrdinal { text: "1.5".into() }));
    assert_eq!(problem("cuda:18446744073709551615"), (Some(0), P::BadOrdinal { text: "18446744073709551615".into() }));
    assert_eq!(problem("cpu:-1"), (Some(0), P::BadCount { text: "-1".into() }));
    assert_eq!(problem("cpu:four"), (Some(0), P::BadCount { text: "four".into() }));
    assert_eq!(problem("cpu:0"), (Some(0), P::NoDevices));
    assert_eq!(problem("cpu:100000"), (Some(0), P::CountOverLimit { count: 100_000, limit: MAX_DEVICES }));
    let huge = format!("cpu:{}", "9".repeat(60));
    assert_eq!(problem(&huge), (Some(0), P::CountOverLimit { count: u64::MAX, limit: MAX_DEVICES }));
    assert_eq!(problem("cpu:3-1"), (Some(0), P::ReversedRange { first: 3, last: 1 }));
    assert_eq!(problem("cuda:0,cpu:5-4"), (Some(1), P::ReversedRange { first: 5, last: 4 }));
    assert_eq!(problem("cpu:0,cpu:0"), (Some(1), P::Duplicate { device: DeviceId::cpu(0) }));
    assert_eq!(problem("cuda:0-3,2"), (Some(1), P::Duplicate { device: DeviceId::cuda(2) }));
    let list = (0..=MAX_DEVICES).map(|i| format!("cpu:{i}")).collect::<Vec<_>>().join(",");
    assert_eq!(problem(&list), (None, P::TooMany { count: MAX_DEVICES + 1, limit: MAX_DEVICES }));
    // A hostile range is refused by its count, before anything is allocated for it.
    let all = format!("cpu:0-{}", usize::MAX - 1);
    assert_eq!(problem(&all), (None, P::TooMany { count: usize::MAX, limit: MAX_DEVICES }));
    // One device asked for, several named.
    for text in ["cpu:0,cpu:1", "cpu:0-3", "cuda:0,1"] {
        match Device::parse(text) {
            Err(Error::InvalidDeviceList { problem: P::NotOne { .. }, .. }) => {}
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn messages_say_what_is_wrong_and_what_would_fix_it() {
    let message = |text: &str| text.parse::<DeviceList>().unwrap_err().to_string();
    assert_eq!(message("tpu:0"), "devices `tpu:0`: unknown device kind `tpu`; use cpu:N or cuda:N");
    assert!(message("cpu:0").contains("at least one device"));
    assert!(message("cpu:0,cpu:0").contains("cpu:0 is listed twice"));
    assert!(message("cpu:100000").contains("100000 is over the limit of 1024 (MAX_DEVICES)"));
    assert!(message("cpu:-1").contains("not a positive integer"));
    assert!(message("cpu:3-1").contains("runs backwards"));
    let list = (0..=MAX_DEVICES).map(|i| format!("cpu:{i}")).collect::<Vec<_>>().join(",");
    assert!(message(&list).contains("1025 devices are over the limit of 1024 devices"));
}

/// Every list of up to four distinct devices from `pool` reads back from its `Display`.
fn every_list_reads_back(pool: &[DeviceId]) {
    let mut lists: Vec<Vec<DeviceId>> = vec![Vec::new()];
    for _ in 0..4 {
        let longer: Vec<Vec<DeviceId>> = lists
            .iter()
            .flat_map(|list| {
                pool.iter().filter(|id| !list.contains(id)).map(move |id| [list.clone(), vec![*id]].concat())
            })
            .collect();
        for list in &longer {
            let list = DeviceList(list.clone());
            assert_eq!(list.to_string().parse::<DeviceList>().unwrap(), list, "{list}");
        }
        lists = longer;
    }
}

#[test]
fn display_writes_the_canonical_form_and_reads_back() {
    let cases = [
        ("cpu:4", "cpu:4"),
        ("cpu:0-3", "cpu:4"),
        ("cpu:0,1,2", "cpu:3"),
        ("cpu:1", "cpu:1"),
        ("cpu:2-2", "cpu:2-2"),
        ("cpu:1-3", "cpu:1-3"),
        ("cuda:1", "cuda:1"),
        ("cuda:0,1", "cuda:0-1"),
        ("cpu:0,cuda:0", "cpu:0,cuda:0"),
        ("cpu:3,cpu:1", "cpu:3,cpu:1"),
        ("cpu:0-1,cpu:3,cuda:0,2-3", "cpu:0-1,cpu:3,cuda:0,cuda:2-3"),
        ("cuda:0,cpu:0-1", "cuda:0,cpu:0-1"),
        ("cpu:1,cpu:0", "cpu:1,cpu:0"),
    ];
    for (text, canonical) in cases {
        let list: DeviceList = text.parse().unwrap();
        assert_eq!(list.to_string(), canonical, "{text}");
        assert_eq!(canonical.parse::<DeviceList>().unwrap(), list, "{canonical} reads back");
    }
    // Every list of up to four devices among cpu:0-2 and cuda:0-1 reads back to itself.
    let pool = [DeviceId::cpu(0), DeviceId::cpu(1), DeviceId::cpu(2), DeviceId::cuda(0), DeviceId::cuda(1)];
    every_list_reads_back(&pool);
    let opened = Device::parse_list("cpu:1-2").unwrap();
    assert_eq!(DeviceList::of(&opened).to_string(), "cpu:1-2");
    // With logical devices too: every list of up to four among cpu:0-1, cuda:0 and the two
    // halves of cuda:1 reads back to itself.
    let pool = [
        DeviceId::cpu(0),
        DeviceId::cpu(1),
        DeviceId::cuda(0),
        DeviceId::cuda_logical(1, 0, 2),
        DeviceId::cuda_logical(1, 1, 2),
    ];
    every_list_reads_back(&pool);
}

#[test]
fn logical_devices_split_a_gpu() {
    use DeviceListProblem as P;
    assert_eq!(ids("cuda:0x4"), ["cuda:0x4#0", "cuda:0x4#1", "cuda:0x4#2", "cuda:0x4#3"]);
    assert_eq!(ids("cuda:0x2#1"), ["cuda:0x2#1"]);
    assert_eq!(ids("cuda:0-1x2"), ["cuda:0x2#0", "cuda:0x2#1", "cuda:1x2#0", "cuda:1x2#1"]);
    assert_eq!(ids("cpu:0,cuda:0x2"), ["cpu:0", "cuda:0x2#0", "cuda:0x2#1"]);
    assert_eq!(ids("cuda:0x1"), ["cuda:0x1#0"]);
    for (text, canonical) in [
        ("cuda:0x4", "cuda:0x4"),
        ("cuda:0-1x2", "cuda:0x2,cuda:1x2"),
        ("cpu:0,cuda:0x2", "cpu:0-0,cuda:0x2"),
        ("cuda:0x2#1,cuda:0x2#0", "cuda:0x2#1,cuda:0x2#0"),
        ("cuda:0x3#0,cuda:0x3#1", "cuda:0x3#0,cuda:0x3#1"),
    ] {
        let list: DeviceList = text.parse().unwrap();
        assert_eq!(list.to_string(), canonical, "{text}");
        assert_eq!(canonical.parse::<DeviceList>().unwrap(), list, "{canonical} reads back");
    }
    assert_eq!("cuda:0x4#2".parse::<DeviceId>().unwrap(), DeviceId::cuda_logical(0, 2, 4));
    assert_eq!(problem("cpu:0x2"), (Some(0), P::SplitCpu));
    assert_eq!(problem("cuda:0x0"), (Some(0), P::BadSplit { text: "x0".into() }));
    assert_eq!(problem("cuda:0x2#2"), (Some(0), P::BadSplit { text: "x2#2".into() }));
    assert_eq!(problem("cuda:0xz"), (Some(0), P::BadSplit { text: "xz".into() }));
    assert_eq!(problem("cuda:0-1x2#0"), (Some(0), P::BadSplit { text: "0-1x2#...".into() }));
    assert_eq!(problem("cuda:0,cuda:0x2"), (Some(1), P::SplitConflict { ordinal: 0 }));
    assert_eq!(problem("cuda:0x2,cuda:0x3"), (Some(1), P::SplitConflict { ordinal: 0 }));
    assert_eq!(problem("cuda:0x2#1,cuda:0x2#1"), (Some(1), P::Duplicate { device: DeviceId::cuda_logical(0, 1, 2) }));
    assert!(matches!(problem(&format!("cuda:0x{}", MAX_DEVICES + 1)).1, P::BadSplit { .. }));
    assert!(matches!(problem("cuda:0-1x1000").1, P::TooMany { count: 2000, .. }));
    let message = problem("cuda:0,cuda:0x2").1.to_string();
    assert!(message.contains("whole and split") && message.contains("cuda:0x"), "{message}");
    // Without the feature or a driver, opening one is the usual clear error.
    if let Err(err) = Device::parse_list("cuda:0x2") {
        assert!(matches!(err, Error::CudaUnavailable(_)), "{err:?}");
        assert!(err.to_string().contains("cuda:0x2#0"), "{err}");
    }
}
