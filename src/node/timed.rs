//! A map whose entries fall due at a time: the leader's leases and waiter deadlines.
//!
//! The leader looks for work on every tick. Scanning every held lock each time costs time in
//! proportion to the locks held (at a million locks, all of a core), so the entries are also
//! kept ordered by the time they next need a look, and a tick reads only those that are due.
//!
//! An entry is due at its deadline; once the expiry or cancel it calls for has been proposed, it
//! is due again only `retry` after the proposal (in case that proposal was lost), and never again
//! when retries are switched off (a known bug the chaos checker must catch).

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

use super::Micros;

/// What makes an entry due.
pub trait Deadline {
    /// When the entry runs out.
    fn deadline(&self) -> Micros;
    /// When the command it calls for was last proposed, if it was.
    fn proposed_at(&self) -> Option<Micros>;
}

#[derive(Debug)]
pub struct TimedMap<K: Ord + Clone, V: Deadline> {
    map: BTreeMap<K, V>,
    due: BTreeSet<(Micros, K)>,
    retry: Micros,
    never_retry: bool,
}

impl<K: Ord + Clone, V: Deadline> TimedMap<K, V> {
    pub fn new(retry: Micros, never_retry: bool) -> Self {
        TimedMap {
            map: BTreeMap::new(),
            due: BTreeSet::new(),
            retry,
            never_retry,
        }
    }

    fn due_at(&self, v: &V) -> Option<Micros> {
        match v.proposed_at() {
            None => Some(v.deadline()),
            Some(_) if self.never_retry => None,
            Some(at) => Some(v.deadline().max(at.saturating_add(self.retry))),
        }
    }

    pub fn get<Q: Ord + ?Sized>(&self, k: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.map.get(k)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, k: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.map.contains_key(k)
    }

    /// The stored key equal to `k` and its value.
    pub fn get_key_value<Q: Ord + ?Sized>(&self, k: &Q) -> Option<(&K, &V)>
    where
        K: Borrow<Q>,
    {
        self.map.get_key_value(k)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The keys in `range`, in key order.
    pub fn range_keys(&self, range: impl std::ops::RangeBounds<K>) -> Vec<K> {
        self.map.range(range).map(|(k, _)| k.clone()).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter()
    }

    pub fn insert(&mut self, k: K, v: V) -> Option<V> {
        let old = self.remove_entry(&k).map(|(_, v)| v);
        if let Some(at) = self.due_at(&v) {
            self.due.insert((at, k.clone()));
        }
        self.map.insert(k, v);
        old
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.remove_entry(k).map(|(_, v)| v)
    }

    fn remove_entry<Q: Ord + ?Sized>(&mut self, k: &Q) -> Option<(K, V)>
    where
        K: Borrow<Q>,
    {
        let (key, old) = self.map.remove_entry(k)?;
        if let Some(at) = self.due_at(&old) {
            self.due.remove(&(at, key.clone()));
        }
        Some((key, old))
    }

    /// Changes an entry in place (its due time follows).
    pub fn update<Q: Ord + ?Sized>(&mut self, k: &Q, f: impl FnOnce(&mut V))
    where
        K: Borrow<Q>,
    {
        if let Some((key, mut v)) = self.remove_entry(k) {
            f(&mut v);
            self.insert(key, v);
        }
    }

    pub fn clear(&mut self) {
        self.map.clear();
        self.due.clear();
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&K, &V) -> bool) {
        let gone: Vec<K> = self
            .map
            .iter()
            .filter(|(k, v)| !keep(k, v))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove_entry(&k);
        }
    }

    /// The entries due at `now`, in key order; reads only those.
    ///
    /// At most `limit` of them: those that fell due first.
    pub fn due_first(&self, now: Micros, limit: usize) -> Vec<(&K, &V)> {
        let mut out: Vec<(&K, &V)> = self
            .due
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .filter_map(|(_, k)| self.map.get_key_value(k))
            .collect();
        out.sort_by(|a, b| a.0.cmp(b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct E {
        deadline: Micros,
        proposed: Option<Micros>,
    }

    impl Deadline for E {
        fn deadline(&self) -> Micros {
            self.deadline
        }
        fn proposed_at(&self) -> Option<Micros> {
            self.proposed
        }
    }

    fn e(deadline: Micros) -> E {
        E {
            deadline,
            proposed: None,
        }
    }

    fn keys(m: &TimedMap<&'static str, E>, now: Micros) -> Vec<&'static str> {
        first_keys(m, now, usize::MAX)
    }

    fn first_keys(m: &TimedMap<&'static str, E>, now: Micros, limit: usize) -> Vec<&'static str> {
        m.due_first(now, limit)
            .into_iter()
            .map(|(k, _)| *k)
            .collect()
    }

    /// Agrees with the scan it replaces: `deadline <= now` and not proposed within `retry`.
    #[test]
    fn due_matches_a_full_scan() {
        let mut m = TimedMap::new(100, false);
        m.insert("c", e(30));
        m.insert("a", e(10));
        m.insert("b", e(50));
        assert_eq!(keys(&m, 5), Vec::<&str>::new());
        assert_eq!(keys(&m, 30), vec!["a", "c"]);
        // Proposed at 30: not due again before 130.
        m.update(&"a", |v| v.proposed = Some(30));
        assert_eq!(keys(&m, 60), vec!["b", "c"]);
        assert_eq!(keys(&m, 130), vec!["a", "b", "c"]);
        // Renewed: a new deadline replaces the old one.
        m.insert("c", e(500));
        assert_eq!(keys(&m, 130), vec!["a", "b"]);
        assert_eq!(m.remove(&"b"), Some(e(50)));
        assert_eq!(keys(&m, 1000), vec!["a", "c"]);
        m.retain(|k, _| *k != "a");
        assert_eq!(keys(&m, 1000), vec!["c"]);
        assert_eq!(m.len(), 1);
        m.clear();
        assert_eq!(keys(&m, 1000), Vec::<&str>::new());
    }

    /// A bounded read takes those that fell due first, and still hands them in key order.
    #[test]
    fn due_first_takes_the_earliest() {
        let mut m = TimedMap::new(100, false);
        m.insert("d", e(10));
        m.insert("a", e(40));
        m.insert("c", e(20));
        m.insert("b", e(30));
        assert_eq!(first_keys(&m, 35, 2), vec!["c", "d"]);
        assert_eq!(first_keys(&m, 35, 3), vec!["b", "c", "d"]);
        assert_eq!(first_keys(&m, 35, 10), vec!["b", "c", "d"]);
        assert_eq!(first_keys(&m, 35, 0), Vec::<&str>::new());
    }

    #[test]
    fn without_retries_a_proposed_entry_is_never_due_again() {
        let mut m = TimedMap::new(100, true);
        m.insert("a", e(10));
        m.update(&"a", |v| v.proposed = Some(10));
        assert_eq!(keys(&m, 1_000_000), Vec::<&str>::new());
        assert!(m.contains_key(&"a"));
        assert_eq!(m.remove(&"a").map(|v| v.deadline), Some(10));
    }
}
