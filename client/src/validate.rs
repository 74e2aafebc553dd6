//! The rules names and IDs must follow, shared by the agent (which enforces them at its
//! API edge) and by clients (which can check before sending).
//!
//! Each check returns the reason as a phrase (`"must be a DNS subdomain"`); the caller
//! prefixes the field path, so errors read `operations[3].resource.name: must be …`.

use crate::types::{NewOperation, PluginKind, PluginRef, ResourceIdentifier, Timestamp};

/// Longest operation ID accepted, in bytes.
pub const MAX_OPERATION_ID_LEN: usize = 1024;
/// Longest uid accepted, in bytes.
pub const MAX_UID_LEN: usize = 256;

/// An RFC 1123 DNS subdomain as Kubernetes defines it: at most 253 characters of
/// lowercase letters, digits, `-` and `.`, each dot-separated label starting and ending
/// with a letter or digit. Backup and restore names become path components, so this
/// also keeps `/`, `..` and empty names out.
pub fn dns_subdomain(value: &str) -> Result<(), String> {
    const MSG: &str = "must be a DNS subdomain (lowercase letters, digits, '-' and '.', \
                       starting and ending with a letter or digit, at most 253 characters)";
    if value.is_empty() || value.len() > 253 {
        return Err(MSG.to_string());
    }
    let label_ok = |label: &str| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes[0].is_ascii_alphanumeric()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
    };
    if value.split('.').all(label_ok) {
        Ok(())
    } else {
        Err(MSG.to_string())
    }
}

/// An RFC 1123 DNS label (a namespace name): at most 63 characters, no dots.
pub fn dns_label(value: &str) -> Result<(), String> {
    if value.len() <= 63 && !value.contains('.') && dns_subdomain(value).is_ok() {
        Ok(())
    } else {
        Err(
            "must be a DNS label (lowercase letters, digits and '-', starting and ending \
             with a letter or digit, at most 63 characters)"
                .to_string(),
        )
    }
}

/// Velero's `sanitizeName` (pkg/plugin/clientmgmt): a plugin name without `/` is a
/// legacy, un-namespaced one and means `velero.io/<name>`. Applied at the API edge to
/// every plugin name the agent is given, before [`plugin_name`] checks it.
pub fn legacy_plugin_name(name: &mut String) {
    if !name.contains('/') {
        name.insert_str(0, "velero.io/");
    }
}

/// Longest part after the `/` of a plugin name, in bytes.
pub const MAX_PLUGIN_NAME_PART: usize = 253;

/// A plugin name by Velero's rule (`ValidatePluginName`, pkg/plugin/framework/common):
/// exactly two parts separated by `/`, both non-empty, the first a DNS subdomain. The
/// second may hold anything else, as in Velero, except control characters (plugin names
/// reach logs, environment variables and metrics labels) and past
/// [`MAX_PLUGIN_NAME_PART`] bytes.
pub fn plugin_name(value: &str) -> Result<(), String> {
    const FORMAT: &str = "<DNS subdomain>/<non-empty name>";
    let parts: Vec<&str> = value.split('/').collect();
    let [domain, name] = parts.as_slice() else {
        return Err(format!(
            "must have exactly two parts separated by '/' ({FORMAT})"
        ));
    };
    if domain.is_empty() || name.is_empty() {
        return Err(format!("both parts must be non-empty ({FORMAT})"));
    }
    dns_subdomain(domain).map_err(|e| format!("the first part {domain:?} {e}"))?;
    if name.len() > MAX_PLUGIN_NAME_PART {
        return Err(format!(
            "the part after '/' must be at most {MAX_PLUGIN_NAME_PART} bytes (got {})",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("must not contain control characters".to_string());
    }
    Ok(())
}

/// Longest item name accepted, in bytes.
pub const MAX_ITEM_NAME_LEN: usize = 253;

/// A Kubernetes object name as the API server takes it for any resource: a path
/// segment name (apimachinery's `IsValidPathSegmentName`: not `.` or `..`, no `/`, no
/// `%`), non-empty, at most [`MAX_ITEM_NAME_LEN`] bytes, no control characters. RBAC
/// names such as `system:aggregate-to-admin` are valid; resource types that demand DNS
/// names are stricter, which is the API server's business. Names become tarball paths
/// at finalize (`<name>.json`): the rule keeps them one path component.
pub fn item_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".to_string());
    }
    if value.len() > MAX_ITEM_NAME_LEN {
        return Err(format!(
            "must be at most {MAX_ITEM_NAME_LEN} bytes (got {})",
            value.len()
        ));
    }
    if value == "." || value == ".." {
        return Err(format!("must not be {value:?}"));
    }
    if let Some(c) = value
        .chars()
        .find(|c| matches!(c, '/' | '%') || c.is_control())
    {
        return Err(format!(
            "must not contain {c:?} (a Kubernetes name is a path segment: no '/', '%' or \
             control characters)"
        ));
    }
    Ok(())
}

/// Largest owner `object` accepted, serialized, in bytes.
pub const MAX_OWNER_OBJECT_BYTES: usize = 64 * 1024;

/// The backup server's representation of an owner (`start`'s `object`): a JSON object
/// of at most [`MAX_OWNER_OBJECT_BYTES`] serialized.
pub fn owner_object(value: &serde_json::Value) -> Result<(), String> {
    if !value.is_object() {
        return Err(
            "must be a JSON object (the backup server's representation of the \
                    backup or restore)"
                .to_string(),
        );
    }
    let size = serde_json::to_string(value)
        .map(|s| s.len())
        .unwrap_or(usize::MAX);
    if size > MAX_OWNER_OBJECT_BYTES {
        return Err(format!(
            "must be at most {MAX_OWNER_OBJECT_BYTES} bytes serialized (got {size})"
        ));
    }
    Ok(())
}

/// A snapshotter's operation ID: non-empty, at most 1024 bytes, no NUL (it is passed
/// to command snapshotters as an argument).
pub fn operation_id(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".to_string());
    }
    if value.len() > MAX_OPERATION_ID_LEN {
        return Err(format!(
            "must be at most {MAX_OPERATION_ID_LEN} bytes (got {})",
            value.len()
        ));
    }
    if value.contains('\0') {
        return Err("must not contain NUL".to_string());
    }
    Ok(())
}

/// An owner's uid: non-empty, at most 256 bytes, printable.
pub fn uid(value: &str) -> Result<(), String> {
    printable(value, MAX_UID_LEN)
}

/// Non-empty text of at most `max` bytes without control characters.
fn printable(value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
        return Err(format!(
            "must be non-empty printable text of at most {max} bytes"
        ));
    }
    Ok(())
}

/// Longest backup-server name or instance accepted, in bytes.
pub const MAX_SERVER_FIELD_LEN: usize = 253;

/// A backup server's name: empty (the unnamed server, to which owners started without
/// `server` belong), `NAME` or `NAMESPACE/NAME`, each part lowercase ASCII letters,
/// digits, `-` and `.`, beginning and ending with a letter or digit (Kubernetes' rule
/// for object names), at most 253 bytes in all. One spelling per server: names that
/// only look alike (a zero-width space, a trailing blank, a Cyrillic letter) are refused
/// rather than become different servers.
pub fn server_name(value: &str) -> Result<(), String> {
    let part_ok = |part: &str| {
        let bytes = part.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        !bytes.is_empty()
            && bytes.first().is_some_and(alnum)
            && bytes.last().is_some_and(alnum)
            && bytes.iter().all(|b| alnum(b) || *b == b'-' || *b == b'.')
    };
    let parts: Vec<&str> = value.split('/').collect();
    if value.is_empty()
        || (value.len() <= MAX_SERVER_FIELD_LEN
            && parts.len() <= 2
            && parts.iter().all(|p| part_ok(p)))
    {
        return Ok(());
    }
    Err(format!(
        "must be empty, NAME or NAMESPACE/NAME, each of lowercase letters, digits, '-' and \
         '.' beginning and ending with a letter or digit, at most {MAX_SERVER_FIELD_LEN} bytes"
    ))
}

/// A backup server's instance (a pod uid, a boot time): non-empty, printable, at most
/// 253 bytes.
pub fn server_instance(value: &str) -> Result<(), String> {
    printable(value, MAX_SERVER_FIELD_LEN)
}

/// A Kubernetes object reference, by Kubernetes' rules: the group a DNS subdomain (or
/// empty, the core group), the resource a plural resource name, the namespace a DNS
/// label (Kubernetes' rule for namespaces; empty for cluster-scoped items), the name an
/// [`item_name`]. Reports the first bad field as `(field, reason)`.
pub fn resource(r: &ResourceIdentifier) -> Result<(), (&'static str, String)> {
    if !r.group.is_empty() {
        dns_subdomain(&r.group).map_err(|e| ("group", e))?;
    }
    // `.` and `..` fit the characters but name directories (of a backup tarball).
    let resource_ok = !matches!(r.resource.as_str(), "" | "." | "..")
        && r.resource.len() <= 253
        && r.resource
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.'));
    if !resource_ok {
        return Err((
            "resource",
            "must be a resource name (letters, digits, '-' and '.')".to_string(),
        ));
    }
    if !r.namespace.is_empty() {
        dns_label(&r.namespace).map_err(|e| ("namespace", e))?;
    }
    item_name(&r.name).map_err(|e| ("name", e))
}

/// How far ahead of the agent's clock an operation's `created` may be: clocks of the
/// backup server's node and the agent's may differ a little, not by more.
pub const MAX_CREATED_AHEAD: std::time::Duration = std::time::Duration::from_secs(300);

/// An operation's `created` (when the plugin returned it), given the time `now`: not
/// before the Unix epoch, and at most [`MAX_CREATED_AHEAD`] after `now` (the timeout
/// counts from it: a time far ahead would put it off).
pub fn created(value: Timestamp, now: Timestamp) -> Result<(), String> {
    if value < Timestamp::UNIX_EPOCH {
        return Err("must not be before 1970-01-01T00:00:00Z".to_string());
    }
    if value > now + MAX_CREATED_AHEAD {
        return Err(format!(
            "must not be more than {} ahead of the agent's clock",
            crate::GoDuration(MAX_CREATED_AHEAD)
        ));
    }
    Ok(())
}

/// Refuses the catch-all of a wire enum (a name this version does not know), naming
/// the values it knows.
pub fn known<T: Copy + PartialEq + std::fmt::Display>(value: T, all: &[T]) -> Result<(), String> {
    if all.contains(&value) {
        return Ok(());
    }
    let names: Vec<String> = all.iter().map(T::to_string).collect();
    Err(format!(
        "unknown value; expected one of {}",
        names.join(", ")
    ))
}

/// Checks one operation of `addOperations` at time `now` (its plugin name already
/// through [`legacy_plugin_name`]), returning the bad field's path below it
/// (`resource.name`, `postOperationItems[2].namespace`) and the reason.
pub fn new_operation(op: &NewOperation, now: Timestamp) -> Result<(), (String, String)> {
    let PluginRef { name, kind } = &op.plugin;
    known(*kind, PluginKind::ALL).map_err(|e| ("plugin.kind".to_string(), e))?;
    plugin_name(name).map_err(|e| ("plugin.name".to_string(), e))?;
    resource(&op.resource).map_err(|(f, e)| (format!("resource.{f}"), e))?;
    operation_id(&op.operation_id).map_err(|e| ("operationId".to_string(), e))?;
    for (i, item) in op.post_operation_items.iter().enumerate() {
        resource(item).map_err(|(f, e)| (format!("postOperationItems[{i}].{f}"), e))?;
    }
    if let Some(t) = op.created {
        created(t, now).map_err(|e| ("created".to_string(), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_subdomain_accepts_kubernetes_names_and_refuses_paths() {
        for good in ["a", "backup-1", "nightly.2024-01-01", "0abc"] {
            assert!(dns_subdomain(good).is_ok(), "{good}");
        }
        let long = "a".repeat(254);
        for bad in [
            "", "..", "a/b", "../etc", "Backup", "-a", "a-", "a..b", ".a", "a_b", &long,
        ] {
            assert!(dns_subdomain(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn plugin_names_follow_velero_rule_with_exact_messages() {
        // Velero's own accepted cases (server_mux_test.go), and a legacy name mapped.
        for good in [
            "velero.io/csi-pvc",
            "example.io/azure",
            "with-dashes/name",
            "prefix/Uppercase_Is_OK_123",
            "1.2.3.4/5678",
            "example.com/my plugin: v2",
            &format!("{}/name", "a".repeat(253)),
        ] {
            assert_eq!(plugin_name(good), Ok(()), "{good}");
        }
        let two = "must have exactly two parts separated by '/' (<DNS subdomain>/<non-empty name>)";
        let empty = "both parts must be non-empty (<DNS subdomain>/<non-empty name>)";
        assert_eq!(plugin_name("csi").unwrap_err(), two);
        assert_eq!(plugin_name("a/b/c").unwrap_err(), two);
        assert_eq!(plugin_name("//").unwrap_err(), two);
        assert_eq!(plugin_name("velero.io/").unwrap_err(), empty);
        assert_eq!(plugin_name("/csi").unwrap_err(), empty);
        assert_eq!(plugin_name("/").unwrap_err(), empty);
        assert_eq!(
            plugin_name("Velero.io/csi").unwrap_err(),
            "the first part \"Velero.io\" must be a DNS subdomain (lowercase letters, digits, \
             '-' and '.', starting and ending with a letter or digit, at most 253 characters)"
        );
        assert!(plugin_name(&format!("{}/name", "a".repeat(254))).is_err());
        assert_eq!(
            plugin_name(&format!("a.io/{}", "x".repeat(254))).unwrap_err(),
            "the part after '/' must be at most 253 bytes (got 254)"
        );
        assert_eq!(
            plugin_name("a.io/b\nc").unwrap_err(),
            "must not contain control characters"
        );
    }

    #[test]
    fn legacy_plugin_names_map_to_velero_io_as_velero_sanitizes_them() {
        let mapped = |name: &str| {
            let mut name = name.to_string();
            legacy_plugin_name(&mut name);
            name
        };
        assert_eq!(mapped("pod"), "velero.io/pod");
        assert_eq!(mapped("example.io/copier"), "example.io/copier");
        assert_eq!(mapped(""), "velero.io/");
        assert_eq!(
            plugin_name(&mapped("")).unwrap_err(),
            "both parts must be non-empty (<DNS subdomain>/<non-empty name>)"
        );
    }

    #[test]
    fn item_names_are_kubernetes_path_segments() {
        for good in [
            "pvc-1",
            "system:aggregate-to-admin",
            "system:controller:attachdetach-controller",
            "Upper_Case name",
            "dätä-🦀",
            "a<b>&c",
            "...",
            ".hidden",
            &"n".repeat(253),
        ] {
            assert_eq!(item_name(good), Ok(()), "{good}");
        }
        assert_eq!(item_name("").unwrap_err(), "must not be empty");
        assert_eq!(item_name(".").unwrap_err(), "must not be \".\"");
        assert_eq!(item_name("..").unwrap_err(), "must not be \"..\"");
        assert_eq!(
            item_name(&"n".repeat(254)).unwrap_err(),
            "must be at most 253 bytes (got 254)"
        );
        let path_segment =
            "(a Kubernetes name is a path segment: no '/', '%' or control characters)";
        assert_eq!(
            item_name("../etc").unwrap_err(),
            format!("must not contain '/' {path_segment}")
        );
        assert_eq!(
            item_name("100%").unwrap_err(),
            format!("must not contain '%' {path_segment}")
        );
        assert_eq!(
            item_name("a\u{0}b").unwrap_err(),
            format!("must not contain '\\0' {path_segment}")
        );
        assert_eq!(
            item_name("a\nb").unwrap_err(),
            format!("must not contain '\\n' {path_segment}")
        );
    }

    #[test]
    fn created_is_not_before_the_epoch_nor_far_ahead() {
        let now = time::macros::datetime!(2026-11-22 09:57:45 UTC);
        assert_eq!(created(now, now), Ok(()));
        assert_eq!(created(Timestamp::UNIX_EPOCH, now), Ok(()));
        assert_eq!(created(now + MAX_CREATED_AHEAD, now), Ok(()));
        assert_eq!(
            created(now + MAX_CREATED_AHEAD + time::Duration::SECOND, now).unwrap_err(),
            "must not be more than 5m0s ahead of the agent's clock"
        );
        assert_eq!(
            created(Timestamp::UNIX_EPOCH - time::Duration::SECOND, now).unwrap_err(),
            "must not be before 1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn owner_objects_are_bounded_json_objects() {
        assert_eq!(
            owner_object(&serde_json::json!({"metadata": {"namespace": "velero"}})),
            Ok(())
        );
        assert_eq!(
            owner_object(&serde_json::json!([1])).unwrap_err(),
            "must be a JSON object (the backup server's representation of the backup or restore)"
        );
        // {"a":"xxx…"}: 8 bytes of syntax around the string.
        let fits = serde_json::json!({"a": "x".repeat(MAX_OWNER_OBJECT_BYTES - 8)});
        assert_eq!(owner_object(&fits), Ok(()));
        let over = serde_json::json!({"a": "x".repeat(MAX_OWNER_OBJECT_BYTES - 7)});
        assert_eq!(
            owner_object(&over).unwrap_err(),
            "must be at most 65536 bytes serialized (got 65537)"
        );
    }

    #[test]
    fn operation_ids_are_bounded() {
        assert!(operation_id("snap-1").is_ok());
        assert!(operation_id(&"x".repeat(1024)).is_ok());
        assert_eq!(
            operation_id(&"x".repeat(1025)).unwrap_err(),
            "must be at most 1024 bytes (got 1025)"
        );
        assert!(operation_id("").is_err());
        assert!(operation_id("a\0b").is_err());
    }

    #[test]
    fn resource_errors_name_the_field() {
        let mut r = ResourceIdentifier {
            group: String::new(),
            resource: "persistentvolumeclaims".into(),
            namespace: "ns".into(),
            name: "pvc-1".into(),
        };
        assert!(resource(&r).is_ok());
        r.name = "a/b".into();
        assert_eq!(resource(&r).unwrap_err().0, "name");
        r.name = "system:aggregate-to-admin".into();
        assert!(resource(&r).is_ok());
        r.name = "ok".into();
        r.namespace = "a.b".into();
        assert_eq!(resource(&r).unwrap_err().0, "namespace");
    }
}
