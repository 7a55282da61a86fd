//! Which object owns each claim ([`Claim`]: a service frontend, a node port, or another
//! single-owner map element) of a wanted dataplane state, kept without a second copy of the
//! element keys: the index holds a claim's hash and its owner, and the owner's own rules
//! confirm the claim. Copies of the keys were ~100 bytes an element, the largest index of
//! the host (12.7 MiB at 10k services).

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use hashbrown::HashTable;
use wasmplane_model::ObjectKey;

use crate::nft::{Claim, ElementKey, ObjectRules, claim};

/// A wanted state: what the index describes, and what confirms its answers.
pub(super) type Objects = BTreeMap<ObjectKey, Arc<ObjectRules>>;

struct Owned {
    hash: u64,
    /// One per object, shared by all its elements.
    owner: Arc<ObjectKey>,
}

/// Owners of the claims [`ObjectRules::claims`] lists (shared-set elements have none).
#[derive(Default)]
pub(super) struct ElementOwners<S = RandomState> {
    /// Randomly keyed by default: element keys come from guests.
    hasher: S,
    table: HashTable<Owned>,
}

impl<S: BuildHasher + Default> ElementOwners<S> {
    /// The index of every object of `objects`.
    #[cfg(test)]
    pub fn of(objects: &Objects) -> Self {
        let mut owners = Self::default();
        for (key, rules) in objects {
            owners.insert_object(key, rules);
        }
        owners
    }

    /// Records `key` as the owner of its rules' claims. They must be free (see
    /// [`ElementOwners::owner`]): the first owner wins, and callers refuse the rest.
    pub fn insert_object(&mut self, key: &ObjectKey, rules: &ObjectRules) {
        let owner = Arc::new(key.clone());
        for claim in rules.claims() {
            let hash = self.hasher.hash_one(claim);
            self.table.insert_unique(hash, Owned { hash, owner: owner.clone() }, |o| o.hash);
        }
    }

    /// Forgets `key` as the owner of the claims of `rules` (what it had).
    pub fn remove_object(&mut self, key: &ObjectKey, rules: &ObjectRules) {
        for claim in rules.claims() {
            let hash = self.hasher.hash_one(claim);
            if let Ok(found) = self.table.find_entry(hash, |o| o.hash == hash && *o.owner == *key) {
                found.remove();
            }
        }
    }

    /// The object of `objects` that owns what `element` claims, if any. Only objects that
    /// are in `objects` answer: one removed from it and not yet from the index owns nothing.
    pub fn owner<'a>(&'a self, element: &ElementKey, objects: &Objects) -> Option<&'a ObjectKey> {
        self.owner_of(&claim(element), objects)
    }

    fn owner_of<'a>(&'a self, claim: &Claim<'_>, objects: &Objects) -> Option<&'a ObjectKey> {
        let hash = self.hasher.hash_one(claim);
        // Different claims may share a hash: the owner's rules must make this one.
        self.table
            .find(hash, |o| o.hash == hash && objects.get(&*o.owner).is_some_and(|rules| rules.holds_claim(claim)))
            .map(|o| &*o.owner)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether this is the index of `objects`: each of their claims answers with its object,
    /// and nothing else is indexed. For debug checks of the paths that keep it.
    pub fn describes(&self, objects: &Objects) -> bool {
        let mut owned = 0;
        for (key, rules) in objects {
            for claim in rules.claims() {
                owned += 1;
                if self.owner_of(&claim, objects) != Some(key) {
                    return false;
                }
            }
        }
        owned == self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmplane_model::CompactString;

    fn rules(elements: &[(&str, &str)]) -> ObjectRules {
        let mut rules = ObjectRules::default();
        for (map, key) in elements {
            rules.elements.insert(((*map).into(), (*key).into()), CompactString::default());
        }
        rules
    }

    fn element(map: &str, key: &str) -> ElementKey {
        (map.into(), key.into())
    }

    #[test]
    fn owners_follow_objects_in_and_out() {
        let (a, b) = (ObjectKey::new("default", "a"), ObjectKey::new("default", "b"));
        let mut objects = Objects::new();
        objects
            .insert(a.clone(), Arc::new(rules(&[("service-ips", "10.96.0.1 . tcp . 80"), ("hairpin", "10.244.0.1")])));
        objects.insert(b.clone(), Arc::new(rules(&[("service-ips", "10.96.0.2 . tcp . 80")])));
        let mut owners = ElementOwners::<RandomState>::of(&objects);
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.1 . tcp . 80"), &objects), Some(&a));
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.2 . tcp . 80"), &objects), Some(&b));
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.3 . tcp . 80"), &objects), None);
        // Shared-set elements have no single owner.
        assert_eq!(owners.owner(&element("hairpin", "10.244.0.1"), &objects), None);
        assert_eq!(owners.len(), 2);
        assert!(owners.describes(&objects));

        // Out of the state, not yet out of the index: owns nothing.
        let had = objects.remove(&a).unwrap();
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.1 . tcp . 80"), &objects), None);
        assert!(!owners.describes(&objects), "an entry of an object no longer in the state");
        owners.remove_object(&a, &had);
        assert_eq!(owners.len(), 1);
        assert!(owners.describes(&objects));
        // Removing what another object owns removes nothing.
        owners.remove_object(&a, &objects[&b]);
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.2 . tcp . 80"), &objects), Some(&b));

        // The key is free again for another object.
        let c = ObjectKey::new("default", "c");
        let taken = rules(&[("service-ips", "10.96.0.1 . tcp . 80")]);
        owners.insert_object(&c, &taken);
        objects.insert(c.clone(), Arc::new(taken));
        assert_eq!(owners.owner(&element("service-ips", "10.96.0.1 . tcp . 80"), &objects), Some(&c));
    }

    #[test]
    fn keys_with_one_hash_keep_their_own_owners() {
        // A hasher that gives every key the same hash: each answer must come from the
        // owner's rules, not from the hash.
        #[derive(Default, Clone)]
        struct OneHash;
        impl BuildHasher for OneHash {
            type Hasher = OneHasher;
            fn build_hasher(&self) -> OneHasher {
                OneHasher
            }
        }
        struct OneHasher;
        impl std::hash::Hasher for OneHasher {
            fn finish(&self) -> u64 {
                7
            }
            fn write(&mut self, _: &[u8]) {}
        }
        let mut objects = Objects::new();
        for name in ["a", "b", "c"] {
            objects.insert(ObjectKey::new("default", name), Arc::new(rules(&[("service-ips", name)])));
        }
        let mut owners = ElementOwners::<OneHash>::of(&objects);
        let owner = |owners: &ElementOwners<OneHash>, objects: &Objects, name: &str| {
            owners.owner(&element("service-ips", name), objects).map(|o| o.name.clone())
        };
        for name in ["a", "b", "c"] {
            assert_eq!(owner(&owners, &objects, name).as_deref(), Some(name));
        }
        assert_eq!(owner(&owners, &objects, "d"), None);
        // Removing one object's entry leaves the others with the same hash in place.
        let b = ObjectKey::new("default", "b");
        let had = objects.remove(&b).unwrap();
        owners.remove_object(&b, &had);
        assert_eq!(owners.len(), 2);
        assert_eq!(owner(&owners, &objects, "b"), None);
        assert_eq!(owner(&owners, &objects, "a").as_deref(), Some("a"));
        assert_eq!(owner(&owners, &objects, "c").as_deref(), Some("c"));
    }
}
