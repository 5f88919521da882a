//! [`Resources`]: shared objects a rollout's holotypes can reach, such as the registry of tools that
//! `ToolSchema` and `ToolExecutor` use. The driver provides them; holotypes find them by type.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// A map from type to one shared value of that type. Cloning is cheap.
#[derive(Clone, Default)]
pub struct Resources {
    values: HashMap<TypeId, Arc<dyn Any + Send + Sync>>,
}

impl Resources {
    /// Adds (or replaces) the value of type `T`.
    pub fn insert<T: Any + Send + Sync>(&mut self, value: T) -> &mut Self {
        self.values.insert(TypeId::of::<T>(), Arc::new(value));
        self
    }

    pub fn get<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let value = self.values.get(&TypeId::of::<T>())?.clone();
        value.downcast::<T>().ok()
    }
}

impl fmt::Debug for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Resources({} values)", self.values.len())
    }
}

impl PartialEq for Resources {
    /// Resources compare by identity of their values.
    fn eq(&self, other: &Self) -> bool {
        self.values.len() == other.values.len()
            && self.values.iter().all(|(key, value)| {
                other
                    .values
                    .get(key)
                    .is_some_and(|theirs| Arc::ptr_eq(value, theirs))
            })
    }
}
