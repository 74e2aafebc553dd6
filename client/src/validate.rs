//! The rules names and IDs must follow, shared by the agent (which enforces them at its
//! API edge) and by clients (which can check before sending).
//!
//! Each check returns the reason as a phrase (`"must be a DNS subdomain"`); the caller
//! prefixes the field path, so errors read `operations[3].resource.name: must be …`.

use crate::types::{NewOperation, PluginRef, ResourceIdentifier};

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

/// A plugin name, `domain/name`, as Velero registers plugins.
pub fn plugin_name(value: &str) -> Result<(), String> {
    const MSG: &str = "must be of the form domain/name (a DNS subdomain, '/', then letters, \
                       digits, '-', '_' or '.')";
    let Some((domain, name)) = value.split_once('/') else {
        return Err(MSG.to_string());
    };
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if dns_subdomain(domain).is_ok() && name_ok {
        Ok(())
    } else {
        Err(MSG.to_string())
    }
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
    if value.is_empty() || value.len() > MAX_UID_LEN || value.chars().any(char::is_control) {
        return Err(format!(
            "must be non-empty printable text of at most {MAX_UID_LEN} bytes"
        ));
    }
    Ok(())
}

/// Longest backup-server name or instance accepted, in bytes.
pub const MAX_SERVER_FIELD_LEN: usize = 253;

/// A backup server's name (`velero/velero`): printable, at most 253 bytes; empty is the
/// unnamed server, to which owners started without `server` belong.
pub fn server_name(value: &str) -> Result<(), String> {
    if value.len() > MAX_SERVER_FIELD_LEN || value.chars().any(char::is_control) {
        return Err(format!(
            "must be printable text of at most {MAX_SERVER_FIELD_LEN} bytes"
        ));
    }
    Ok(())
}

/// A backup server's instance (a pod uid, a boot time): non-empty, printable, at most
/// 253 bytes.
pub fn server_instance(value: &str) -> Result<(), String> {
    if value.is_empty() || value.len() > MAX_SERVER_FIELD_LEN || value.chars().any(char::is_control)
    {
        return Err(format!(
            "must be non-empty printable text of at most {MAX_SERVER_FIELD_LEN} bytes"
        ));
    }
    Ok(())
}

/// A Kubernetes object reference. Reports the first bad field as `(field, reason)`.
pub fn resource(r: &ResourceIdentifier) -> Result<(), (&'static str, String)> {
    if !r.group.is_empty() {
        dns_subdomain(&r.group).map_err(|e| ("group", e))?;
    }
    let resource_ok = !r.resource.is_empty()
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
    dns_subdomain(&r.name).map_err(|e| ("name", e))
}

/// Checks one operation of `addOperations`, returning the bad field's path below it
/// (`resource.name`, `postOperationItems[2].namespace`) and the reason.
pub fn new_operation(op: &NewOperation) -> Result<(), (String, String)> {
    let PluginRef { name, .. } = &op.plugin;
    plugin_name(name).map_err(|e| ("plugin.name".to_string(), e))?;
    resource(&op.resource).map_err(|(f, e)| (format!("resource.{f}"), e))?;
    operation_id(&op.operation_id).map_err(|e| ("operationId".to_string(), e))?;
    for (i, item) in op.post_operation_items.iter().enumerate() {
        resource(item).map_err(|(f, e)| (format!("postOperationItems[{i}].{f}"), e))?;
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
    fn plugin_names_need_a_domain_and_a_name() {
        assert!(plugin_name("velero.io/csi-pvc").is_ok());
        assert!(plugin_name("example.com/my_plugin.v2").is_ok());
        for bad in [
            "csi",
            "velero.io/",
            "/csi",
            "Velero.io/csi",
            "a/b/c",
            "a/b c",
        ] {
            assert!(plugin_name(bad).is_err(), "{bad}");
        }
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
        r.name = "ok".into();
        r.namespace = "a.b".into();
        assert_eq!(resource(&r).unwrap_err().0, "namespace");
    }
}
