//! The backup server's side of a test, in the order it happens: start an owner, add its
//! operations, end InProgress, wait for a phase. Many tests open with these steps; with
//! [`Steps`] they read as one line, and what the test is about stays in the test:
//!
//! ```ignore
//! let f = Fixture::new(&[]).await;
//! let owner = f.backup("b").operation(operation(PLUGIN, "gate-1", "a", &[])).end_in_progress().await;
//! f.open_gate("gate-1");
//! let owner = f.backup("b").wait(WaitUntil::ReadyToFinalize).await;
//! ```
//!
//! Each step panics with the step's name when its call fails: these are the steps a test
//! stands on, not the behaviour it checks (a test that expects a step to fail calls the
//! client itself).

use std::time::Duration;

use opmon_client::{Client, NewOperation, Owner, OwnerKind, Owners, PluginKind, WaitUntil};

/// How long a test waits for a phase the agent will reach.
pub const LONG: Duration = Duration::from_secs(120);

/// One owner's steps: configured with the builder methods, run by awaiting a step.
#[must_use = "nothing is sent until a step is awaited"]
pub struct Steps {
    owners: Owners,
    name: String,
    uid: String,
    operations: Vec<NewOperation>,
    item_operation_timeout: Option<Duration>,
    errors: u32,
    warnings: u32,
}

impl Steps {
    /// The steps of owner `name` (uid `u` unless [`Steps::uid`] says otherwise).
    pub fn new(client: &Client, kind: OwnerKind, name: &str) -> Steps {
        Steps::of(client.owners(kind), name)
    }

    /// The steps of owner `name` through `owners` (`client.backups()` or
    /// `client.restores()`).
    pub fn of(owners: Owners, name: &str) -> Steps {
        Steps {
            owners,
            name: name.to_string(),
            uid: "u".to_string(),
            operations: Vec::new(),
            item_operation_timeout: None,
            errors: 0,
            warnings: 0,
        }
    }

    pub fn uid(mut self, uid: &str) -> Self {
        self.uid = uid.to_string();
        self
    }

    /// The owner's item operation timeout (`start`'s `itemOperationTimeout`).
    pub fn item_operation_timeout(mut self, timeout: Duration) -> Self {
        self.item_operation_timeout = Some(timeout);
        self
    }

    /// An operation for `addOperations`.
    pub fn operation(mut self, operation: NewOperation) -> Self {
        self.operations.push(operation);
        self
    }

    /// Operations for `addOperations`.
    pub fn operations(mut self, operations: impl IntoIterator<Item = NewOperation>) -> Self {
        self.operations.extend(operations);
        self
    }

    /// Errors `endInProgress` reports.
    pub fn errors(mut self, errors: u32) -> Self {
        self.errors = errors;
        self
    }

    /// Warnings `endInProgress` reports.
    pub fn warnings(mut self, warnings: u32) -> Self {
        self.warnings = warnings;
        self
    }

    /// `start`, then `addOperations` if there are any: the owner, InProgress.
    pub async fn start(&self) -> Owner {
        let mut start = self.owners.start(&self.name, &self.uid);
        if let Some(timeout) = self.item_operation_timeout {
            start = start.item_operation_timeout(timeout);
        }
        let owner = start
            .await
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        if self.operations.is_empty() {
            return owner;
        }
        // `operation()` makes a BackupItemAction's; a restore's are RestoreItemActions'.
        let mut operations = self.operations.clone();
        if owner.kind == OwnerKind::Restore {
            for op in &mut operations {
                if op.plugin.kind == PluginKind::BackupItemAction {
                    op.plugin.kind = PluginKind::RestoreItemAction;
                }
            }
        }
        self.owners
            .add_operations(&self.name, operations)
            .await
            .unwrap_or_else(|e| panic!("addOperations {}: {e}", self.name));
        self.owners
            .get(&self.name)
            .await
            .unwrap_or_else(|e| panic!("get {}: {e}", self.name))
    }

    /// [`Steps::start`], then `endInProgress`: the owner in the phase that left it.
    pub async fn end_in_progress(&self) -> Owner {
        self.start().await;
        self.owners
            .end_in_progress(&self.name)
            .errors(self.errors)
            .warnings(self.warnings)
            .await
            .unwrap_or_else(|e| panic!("endInProgress {}: {e}", self.name))
    }

    /// `wait` until `until`, at most [`LONG`]; fails the test if it timed out.
    pub async fn wait(&self, until: WaitUntil) -> Owner {
        let waited = self
            .owners
            .wait(&self.name, until, LONG)
            .await
            .unwrap_or_else(|e| panic!("wait {}: {e}", self.name));
        assert!(
            !waited.timed_out,
            "{} did not reach {until:?} within {LONG:?}: {:?}",
            self.name, waited.owner.phase
        );
        waited.owner
    }
}
