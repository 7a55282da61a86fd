//! One watch of every Service of the cluster for all the leader's duties that follow
//! Services (the service sync and the mesh EndpointSlice sync): what a shared informer
//! gives client-go controllers, so that one replica lists and watches the Services once.
//!
//! [`ServiceWatch::run`] runs kube's watcher into a reflector [`Writer`] while leading
//! (through [`crate::Leadership::run_while_leading`]); each duty subscribes
//! ([`ServiceWatch::subscribe`]) and gets a stream like a watcher of its own:
//!
//! - it starts with a complete list, `Init`, `InitApply` for every Service, `InitDone`: at
//!   once from the store when the watch has one, else when the watch's (re)list completes
//!   (a list half done is never handed out);
//! - then every event of the watch in order, deletions and relists (a 410 Gone) included;
//! - when the watch stops (leadership lost) and runs again, the new watch's list reaches it
//!   as a relist, as a watcher's own reconnect would (a duty runs in the same leading terms
//!   as the watch: it is stopped too, mostly).
//!
//! Each subscriber has its own unbounded queue (client-go buffers each listener of a shared
//! informer the same way): a slow duty holds up neither the watch nor the other duty.

use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::StreamExt as _;
use futures::channel::mpsc;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::{self, Event};
use tracing::{debug, warn};

/// One event of the shared watch; its Service is shared by every subscriber.
pub(crate) type ServiceEvent = Event<Arc<Service>>;

/// A subscription's events ([`ServiceWatch::subscribe`]).
pub(crate) type ServiceEvents = mpsc::UnboundedReceiver<ServiceEvent>;

type Subscriber = mpsc::UnboundedSender<ServiceEvent>;

/// The shared watch and its subscribers. Cheap to clone. One [`ServiceWatch::run`] at a
/// time.
#[derive(Clone, Default)]
pub(crate) struct ServiceWatch {
    hub: Arc<Mutex<Hub>>,
}

impl ServiceWatch {
    /// A subscription: the complete list of Services, then every change (see the module doc).
    pub(crate) fn subscribe(&self) -> ServiceEvents {
        self.hub().subscribe()
    }

    /// Lists and watches every Service (kube's watcher relists and retries with backoff on
    /// its own) and feeds the subscribers, until cancelled.
    pub(crate) async fn run(&self, client: kube::Client) {
        self.hub().start();
        let _stop = StopOnDrop(self.hub.clone());
        let mut events =
            watcher::watcher(Api::<Service>::all(client), watcher::Config::default()).default_backoff().boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => self.hub().apply(event),
                Err(e) => warn!("watching Services: {e}"),
            }
        }
        warn!("the Service watch ended");
    }

    /// Ends every subscription.
    fn close(&self) {
        let mut hub = self.hub();
        hub.following.clear();
        hub.waiting.clear();
    }

    fn hub(&self) -> MutexGuard<'_, Hub> {
        // Every method leaves the hub consistent: a panic elsewhere does not poison it.
        self.hub.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `duty` on a watch of its own: a duty run alone, outside [`crate::Operator`].
pub(crate) async fn with_own_watch<F, Fut>(client: kube::Client, duty: F) -> Fut::Output
where
    F: FnOnce(ServiceEvents) -> Fut,
    Fut: Future,
{
    let watch = ServiceWatch::default();
    let events = watch.subscribe();
    let watching = async {
        watch.run(client).await;
        // Ended on its own (kube's watcher does not): so does the subscription, and the duty.
        watch.close();
        std::future::pending::<Infallible>().await
    };
    tokio::select! {
        output = duty(events) => output,
        never = watching => match never {},
    }
}

/// Marks the watch stopped however it stops (cancelled, mostly).
struct StopOnDrop(Arc<Mutex<Hub>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).stop();
    }
}

/// The running watch's picture and who follows it. Every change happens under one lock, so
/// a subscriber's list and the events after it neither overlap nor leave a gap.
#[derive(Default)]
struct Hub {
    /// The running watch's store (kube's reflector); `None` while none runs.
    writer: Option<Writer<Service>>,
    /// Whether the store holds a complete list (not before the first `InitDone`, nor
    /// during a relist).
    complete: bool,
    /// Subscribers that got a complete list and get every event.
    following: Vec<Subscriber>,
    /// Subscribers waiting for the watch's next complete list.
    waiting: Vec<Subscriber>,
}

impl Hub {
    fn subscribe(&mut self) -> ServiceEvents {
        let (subscriber, events) = mpsc::unbounded();
        self.waiting.retain(|s| !s.is_closed());
        match self.writer.as_ref().filter(|_| self.complete) {
            Some(writer) => {
                if send_list(&subscriber, writer) {
                    self.following.push(subscriber);
                }
            }
            None => self.waiting.push(subscriber),
        }
        events
    }

    /// A watch starts: nothing listed yet; those following get its list as a relist.
    fn start(&mut self) {
        self.writer = Some(Writer::default());
        self.complete = false;
        self.following.retain(|s| !s.is_closed());
    }

    /// The watch stopped: a newcomer waits for the next watch's list rather than take this
    /// one's, which nobody follows any more, for a current one.
    fn stop(&mut self) {
        self.writer = None;
        self.complete = false;
    }

    /// One event of the watch: into the store, then to every subscriber following; a
    /// completed list also goes, whole, to those waiting for one.
    fn apply(&mut self, event: Event<Service>) {
        let Some(writer) = self.writer.as_mut() else { return };
        let event = event.modify(slim);
        writer.apply_watcher_event(&event);
        let event = match event {
            Event::Init => {
                self.complete = false;
                Event::Init
            }
            Event::InitApply(service) => Event::InitApply(Arc::new(service)),
            Event::InitDone => {
                self.complete = true;
                Event::InitDone
            }
            Event::Apply(service) => Event::Apply(Arc::new(service)),
            Event::Delete(service) => Event::Delete(Arc::new(service)),
        };
        // A subscriber gone (its duty stopped) is dropped here.
        self.following.retain(|s| s.unbounded_send(event.clone()).is_ok());
        if matches!(event, Event::InitDone) {
            debug!(services = writer.as_reader().len(), "services listed");
            for subscriber in std::mem::take(&mut self.waiting) {
                if send_list(&subscriber, writer) {
                    self.following.push(subscriber);
                }
            }
        }
    }
}

/// What no duty reads goes before the Service is stored and shared: the store holds every
/// Service of the cluster while leading, and server-side apply's field records and kubectl's
/// copy of the last applied object are often bigger than the rest of it together.
fn slim(service: &mut Service) {
    service.metadata.managed_fields = None;
    if let Some(annotations) = service.metadata.annotations.as_mut() {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    service.status = None;
}

/// Sends the store's complete list as a watcher's list; `false` if the subscriber is gone.
fn send_list(subscriber: &Subscriber, writer: &Writer<Service>) -> bool {
    let services = writer.as_reader().state().into_iter().map(Event::InitApply);
    std::iter::once(Event::Init)
        .chain(services)
        .chain(std::iter::once(Event::InitDone))
        .all(|event| subscriber.unbounded_send(event).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, ip: &str) -> Service {
        let mut service = Service::default();
        service.metadata.namespace = Some("default".into());
        service.metadata.name = Some(name.into());
        service.spec =
            Some(k8s_openapi::api::core::v1::ServiceSpec { cluster_ip: Some(ip.into()), ..Default::default() });
        service
    }

    /// What a subscription has received so far, readably: `init`, `+name`, `done`,
    /// `apply name ip`, `delete name`; `closed` once it ended.
    fn received(events: &mut ServiceEvents) -> Vec<String> {
        let mut seen = Vec::new();
        let mut listed = Vec::new();
        loop {
            let event = match events.try_recv() {
                Ok(event) => event,
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Closed) => {
                    seen.push("closed".to_string());
                    break;
                }
            };
            let name = |s: &Service| s.metadata.name.clone().unwrap();
            match event {
                Event::Init => seen.push("init".into()),
                // A list comes in the store's order: sorted here.
                Event::InitApply(s) => listed.push(format!("+{}", name(&s))),
                Event::InitDone => {
                    listed.sort();
                    seen.append(&mut listed);
                    seen.push("done".into());
                }
                Event::Apply(s) => {
                    seen.push(format!("apply {} {}", name(&s), s.spec.as_ref().unwrap().cluster_ip.as_ref().unwrap()))
                }
                Event::Delete(s) => seen.push(format!("delete {}", name(&s))),
            }
        }
        seen.append(&mut listed);
        seen
    }

    /// Stored and shared without what no duty reads; what the duties read stays.
    #[test]
    fn services_are_kept_without_field_records_and_status() {
        let mut hub = Hub::default();
        hub.start();
        let mut bulky = service("a", "10.0.0.1");
        bulky.metadata.managed_fields = Some(vec![Default::default()]);
        bulky.metadata.annotations = Some(
            [("kubectl.kubernetes.io/last-applied-configuration", "{...}"), ("service.cilium.io/global", "true")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
        );
        bulky.status = Some(Default::default());
        hub.apply(Event::Init);
        hub.apply(Event::InitApply(bulky));
        hub.apply(Event::InitDone);
        let mut events = hub.subscribe();
        let Some(Event::InitApply(stored)) =
            std::iter::from_fn(|| events.try_recv().ok()).find(|e| matches!(e, Event::InitApply(_)))
        else {
            panic!("no list")
        };
        assert_eq!(stored.metadata.managed_fields, None);
        assert_eq!(stored.status, None);
        let annotations: Vec<&String> = stored.metadata.annotations.as_ref().unwrap().keys().collect();
        assert_eq!(annotations, ["service.cilium.io/global"], "duties read annotations: only kubectl's copy goes");
        assert_eq!(stored.spec.as_ref().unwrap().cluster_ip.as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn every_subscriber_gets_a_complete_list_then_every_change() {
        let mut hub = Hub::default();
        let mut early = hub.subscribe();
        hub.start();
        hub.apply(Event::Init);
        hub.apply(Event::InitApply(service("a", "10.0.0.1")));
        // Mid-list: waits for the list's end rather than getting half of it.
        let mut mid_list = hub.subscribe();
        hub.apply(Event::InitApply(service("b", "10.0.0.2")));
        assert!(received(&mut early).is_empty(), "nothing before the list is complete");
        hub.apply(Event::InitDone);
        for events in [&mut early, &mut mid_list] {
            assert_eq!(received(events), ["init", "+a", "+b", "done"]);
        }

        hub.apply(Event::Apply(service("c", "10.0.0.3")));
        hub.apply(Event::Delete(service("a", "10.0.0.1")));
        // A duty (re)started now: the current list from the store, no request of its own.
        let mut late = hub.subscribe();
        assert_eq!(received(&mut late), ["init", "+b", "+c", "done"]);
        hub.apply(Event::Apply(service("b", "10.0.0.9")));
        assert_eq!(received(&mut early), ["apply c 10.0.0.3", "delete a", "apply b 10.0.0.9"]);
        assert_eq!(received(&mut late), ["apply b 10.0.0.9"]);

        // A relist (410 Gone) reaches every subscriber as a relist: `c` went meanwhile.
        hub.apply(Event::Init);
        hub.apply(Event::InitApply(service("b", "10.0.0.9")));
        let mut relisting = hub.subscribe();
        hub.apply(Event::InitDone);
        for events in [&mut early, &mut mid_list, &mut late, &mut relisting] {
            assert_eq!(received(events).last().map(String::as_str), Some("done"));
        }
        hub.apply(Event::Apply(service("d", "10.0.0.4")));
        assert_eq!(received(&mut relisting), ["apply d 10.0.0.4"]);

        // A subscriber gone is forgotten; the others go on.
        drop(mid_list);
        hub.apply(Event::Delete(service("d", "10.0.0.4")));
        assert_eq!(hub.following.len(), 3);
        assert_eq!(received(&mut late), ["apply d 10.0.0.4", "delete d"]);
    }

    #[test]
    fn the_next_watch_relists_to_those_following_and_newcomers_wait_for_it() {
        let mut hub = Hub::default();
        hub.start();
        hub.apply(Event::Init);
        hub.apply(Event::InitApply(service("a", "10.0.0.1")));
        hub.apply(Event::InitDone);
        let mut following = hub.subscribe();
        assert_eq!(received(&mut following), ["init", "+a", "done"]);
        hub.stop();
        // While no watch runs (not leading), a newcomer waits, even with a list at hand.
        let mut waiting = hub.subscribe();
        hub.apply(Event::Apply(service("x", "10.0.0.9")));
        hub.start();
        assert!(received(&mut waiting).is_empty());
        hub.apply(Event::Init);
        hub.apply(Event::InitApply(service("b", "10.0.0.2")));
        hub.apply(Event::InitDone);
        // `a` went while no watch ran: the relist tells the one following.
        assert_eq!(received(&mut following), ["init", "+b", "done"]);
        assert_eq!(received(&mut waiting), ["init", "+b", "done"]);
    }
}
