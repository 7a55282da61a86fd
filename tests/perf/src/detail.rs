//! What a real cluster's objects carry besides the fields the host reads (the harness's
//! default; `--minimal-objects` leaves it out, as runs before the seventeenth did):
//! managed fields, owner references, annotations, container specs, probes, volumes,
//! conditions, node images and capacity, modelled on what kubectl, the controllers and the
//! kubelet leave on objects in a kubeadm cluster. The cluster's own objects are the fields
//! the host reads and little else, so without this every byte the API server sends is one
//! the host uses, which no real cluster does. Only fields an object does not set are added,
//! and nothing the host reads changes, except that pods, nodes, namespaces and slices get
//! the standard labels their controllers give them.

use serde_json::{Map, Value, json};

use crate::cluster::Kind;

const CREATED: &str = "2026-11-01T08:00:00Z";

pub fn add(kind: Kind, object: &mut Value) {
    let name = object["metadata"]["name"].as_str().unwrap_or_default().to_string();
    let namespace = object["metadata"]["namespace"].as_str().unwrap_or_default().to_string();
    let uid = uid_of(&format!("{kind:?}/{namespace}/{name}"));
    merge(&mut object["metadata"], json!({"uid": uid, "creationTimestamp": CREATED}));
    match kind {
        Kind::Pod => pod(object, &name),
        Kind::Node => node(object, &name),
        Kind::Service => service(object),
        Kind::EndpointSlice => endpoint_slice(object, &namespace),
        Kind::Namespace => merge(
            object,
            json!({"metadata": {"labels": {"kubernetes.io/metadata.name": name}}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}),
        ),
        Kind::NetworkPolicy => {}
    }
    let manager = match kind {
        Kind::Pod | Kind::EndpointSlice => "kube-controller-manager",
        Kind::Node => "kubelet",
        _ => "kubectl-client-side-apply",
    };
    // The API server records, per manager, every field it set: about the object's own size.
    let mut managed = vec![
        json!({"manager": manager, "operation": "Update", "apiVersion": object["apiVersion"], "time": CREATED, "fieldsType": "FieldsV1", "fieldsV1": fields_v1(&without_status(object))}),
    ];
    if let Some(status) = object.get("status").filter(|s| !s.as_object().is_some_and(Map::is_empty)) {
        managed.push(json!({"manager": "kubelet", "operation": "Update", "apiVersion": object["apiVersion"], "time": CREATED, "fieldsType": "FieldsV1", "fieldsV1": {"f:status": fields_v1(status)}, "subresource": "status"}));
    }
    object["metadata"]["managedFields"] = Value::Array(managed);
}

fn pod(object: &mut Value, name: &str) {
    let app = object["metadata"]["labels"]["app"].as_str().unwrap_or_default().to_string();
    let hash = &uid_of(&app)[..10];
    let volume = format!("kube-api-access-{}", &uid_of(name)[..5]);
    merge(
        object,
        json!({
            "metadata": {
                "generateName": format!("{app}-{hash}-"),
                "labels": {"pod-template-hash": hash},
                "annotations": {"kubectl.kubernetes.io/restartedAt": CREATED},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{app}-{hash}"), "uid": uid_of(&format!("rs/{app}")), "controller": true, "blockOwnerDeletion": true}]
            },
            "spec": {
                "dnsPolicy": "ClusterFirst", "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority", "priority": 0,
                "restartPolicy": "Always", "schedulerName": "default-scheduler", "securityContext": {}, "serviceAccount": "default",
                "serviceAccountName": "default", "terminationGracePeriodSeconds": 30,
                "tolerations": [
                    {"effect": "NoExecute", "key": "node.kubernetes.io/not-ready", "operator": "Exists", "tolerationSeconds": 300},
                    {"effect": "NoExecute", "key": "node.kubernetes.io/unreachable", "operator": "Exists", "tolerationSeconds": 300}
                ],
                "volumes": [{"name": volume, "projected": {"defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
                ]}}]
            },
            "status": {
                "qosClass": "Burstable", "startTime": CREATED, "hostIP": "172.16.0.1", "hostIPs": [{"ip": "172.16.0.1"}],
                "conditions": (["PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled"]
                    .map(|c| json!({"type": c, "status": "True", "lastProbeTime": null, "lastTransitionTime": CREATED}))),
                "containerStatuses": [{
                    "name": "main", "ready": true, "started": true, "restartCount": 0, "image": "registry.example/app:1",
                    "imageID": format!("registry.example/app@sha256:{}{}", uid_of("image"), uid_of("digest")),
                    "containerID": format!("containerd://{}{}", uid_of(name), uid_of(&app)),
                    "state": {"running": {"startedAt": CREATED}}, "lastState": {},
                    "volumeMounts": [{"mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "name": volume, "readOnly": true, "recursiveReadOnly": "Disabled"}]
                }]
            }
        }),
    );
    let probe = json!({"httpGet": {"path": "/healthz", "port": 8080, "scheme": "HTTP"}, "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3});
    if let Some(container) = object["spec"]["containers"].get_mut(0) {
        merge(
            container,
            json!({
                "imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "env": (["LOG_LEVEL", "PORT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "GOMAXPROCS", "DATABASE_URL"]
                    .map(|k| json!({"name": k, "value": format!("{}-{app}", k.to_lowercase())}))),
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                "readinessProbe": probe, "livenessProbe": probe,
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": true},
                "volumeMounts": [{"mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "name": volume, "readOnly": true}]
            }),
        );
    }
}

fn node(object: &mut Value, name: &str) {
    // A node reports the images it holds (up to 50), its capacity and its conditions.
    let images: Vec<Value> = (0..40)
        .map(|i| json!({"names": [format!("registry.example/team-{}/image-{i}@sha256:{}{}", i % 7, uid_of(&format!("{i}")), uid_of(name)), format!("registry.example/team-{}/image-{i}:v{}", i % 7, i % 5)], "sizeBytes": 10_000_000 + i * 1_234_567}))
        .collect();
    let resources = json!({"cpu": "8", "ephemeral-storage": "101430960Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0", "memory": "32827000Ki", "pods": "110"});
    merge(
        object,
        json!({
            "metadata": {
                "labels": {"beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux", "node.kubernetes.io/instance-type": "m6i.2xlarge", "topology.kubernetes.io/region": "region-1"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                    "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///var/run/containerd/containerd.sock"}
            },
            "spec": {"providerID": format!("example://region-1/{name}")},
            "status": {
                "allocatable": resources, "capacity": resources,
                "conditions": ([["MemoryPressure", "False"], ["DiskPressure", "False"], ["PIDPressure", "False"], ["Ready", "True"]]
                    .map(|[t, s]| json!({"type": t, "status": s, "lastHeartbeatTime": CREATED, "lastTransitionTime": CREATED, "reason": format!("Kubelet{t}"), "message": format!("kubelet reports {t} {s}")}))),
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "images": images,
                "nodeInfo": {"architecture": "amd64", "bootID": uid_of(&format!("boot/{name}")), "containerRuntimeVersion": "containerd://1.7.22",
                    "kernelVersion": "6.8.0-1015", "kubeProxyVersion": "", "kubeletVersion": "v1.33.4", "machineID": uid_of(&format!("machine/{name}")),
                    "operatingSystem": "linux", "osImage": "Ubuntu 24.04.1 LTS", "systemUUID": uid_of(&format!("system/{name}"))}
            }
        }),
    );
}

fn service(object: &mut Value) {
    // `kubectl apply` keeps the whole applied object in an annotation.
    let applied = object.to_string();
    merge(
        object,
        json!({
            "metadata": {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": applied}},
            "spec": {"ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "internalTrafficPolicy": "Cluster"},
            "status": {"loadBalancer": {}}
        }),
    );
}

fn endpoint_slice(object: &mut Value, namespace: &str) {
    let service = object["metadata"]["labels"]["kubernetes.io/service-name"].as_str().unwrap_or_default().to_string();
    merge(
        object,
        json!({
            "metadata": {
                "generateName": format!("{service}-"),
                "labels": {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": CREATED},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": uid_of(&format!("Service/{namespace}/{service}")), "controller": true, "blockOwnerDeletion": true}]
            }
        }),
    );
    for endpoint in object["endpoints"].as_array_mut().into_iter().flatten() {
        let pod = endpoint["targetRef"]["name"].as_str().unwrap_or_default().to_string();
        merge(&mut endpoint["targetRef"], json!({"uid": uid_of(&format!("Pod/{namespace}/{pod}"))}));
    }
}

/// Adds what `extra` has and `target` does not; maps merge key by key, anything else that
/// `target` already has stays.
fn merge(target: &mut Value, extra: Value) {
    match (target, extra) {
        (Value::Object(t), Value::Object(e)) => {
            for (k, v) in e {
                match t.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        t.insert(k, v);
                    }
                }
            }
        }
        (t @ Value::Null, e) => *t = e,
        _ => {}
    }
}

fn without_status(object: &Value) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        map.remove("status");
        if let Some(meta) = map.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("managedFields");
        }
    }
    copy
}

/// The API server's record of the fields a manager set (`FieldsV1`): `f:<field>` per map key,
/// `k:{"name":…}` per list item with a name, `.` for the object itself.
fn fields_v1(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (format!("f:{k}"), fields_v1(v))).collect()),
        Value::Array(items) => {
            let mut out = Map::new();
            for (i, item) in items.iter().enumerate() {
                let key = match item.get("name").and_then(Value::as_str) {
                    Some(name) => format!("k:{{\"name\":\"{name}\"}}"),
                    None => format!("i:{i}"),
                };
                let mut fields = fields_v1(item);
                if let Some(f) = fields.as_object_mut() {
                    f.insert(".".into(), json!({}));
                }
                out.insert(key, fields);
            }
            Value::Object(out)
        }
        _ => json!({}),
    }
}

/// A stable UUID-shaped string for `seed`.
fn uid_of(seed: &str) -> String {
    let h = crate::symbol_order::fnv1a(seed.as_bytes());
    let (a, b) = (h, h.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Cluster, Spec};
    use wasmplane_model::state::ClusterObject;

    /// Full objects are several times the bytes, and the host reads the same from them.
    #[test]
    fn full_objects_add_bytes_not_meaning() {
        let spec = Spec { services: 50, endpoints: 1.5, policies: 2, seed: 3, full_objects: false };
        let slim = Cluster::new(spec.clone()).objects();
        let full = Cluster::new(Spec { full_objects: true, ..spec }).objects();
        assert_eq!(slim.len(), full.len());
        let bytes = |objects: &[(Kind, Value)], kind: Kind| {
            objects.iter().filter(|(k, _)| *k == kind).map(|(_, v)| v.to_string().len()).sum::<usize>()
        };
        assert!(
            bytes(&full, Kind::Pod) > 5 * bytes(&slim, Kind::Pod),
            "pods {} → {}",
            bytes(&slim, Kind::Pod),
            bytes(&full, Kind::Pod)
        );
        assert!(
            bytes(&full, Kind::Node) > 10 * bytes(&slim, Kind::Node),
            "nodes {} → {}",
            bytes(&slim, Kind::Node),
            bytes(&full, Kind::Node)
        );
        for ((kind, a), (_, b)) in slim.iter().zip(&full) {
            let read = |v: &Value| wasmplane_sources::convert::object_from_json(v.clone()).unwrap().unwrap();
            let (mut a, b) = (read(a), read(b));
            // The standard labels their controllers give pods, nodes and namespaces are the one
            // thing added that the host keeps; the object's own labels stay as they were.
            let labels = match (&mut a, &b) {
                (ClusterObject::Pod(x), ClusterObject::Pod(y)) => Some((&mut x.labels, &y.labels)),
                (ClusterObject::Node(x), ClusterObject::Node(y)) => Some((&mut x.labels, &y.labels)),
                (ClusterObject::Namespace(x), ClusterObject::Namespace(y)) => Some((&mut x.labels, &y.labels)),
                _ => None,
            };
            if let Some((own, with_standard)) = labels {
                assert!(
                    own.iter().all(|(k, v)| with_standard.get(k) == Some(v)),
                    "{kind:?}: {own:?} in {with_standard:?}"
                );
                *own = with_standard.clone();
            }
            // So is a slice's trigger time (the EndpointSlice controller's annotation), and a
            // service's creation time (which of two claiming one frontend keeps it).
            if let (ClusterObject::EndpointSlice(x), ClusterObject::EndpointSlice(y)) = (&mut a, &b) {
                assert!(x.trigger_time.is_none() && y.trigger_time.is_some(), "{kind:?}: {x:?} / {y:?}");
                x.trigger_time = y.trigger_time;
            }
            if let (ClusterObject::Service(x), ClusterObject::Service(y)) = (&mut a, &b) {
                assert!(x.created_unix.is_none() && y.created_unix.is_some(), "{kind:?}: {x:?} / {y:?}");
                x.created_unix = y.created_unix;
            }
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "{kind:?}");
        }
    }
}
