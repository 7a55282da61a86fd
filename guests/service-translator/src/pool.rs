//! The guest's allocator: segregated free lists for small blocks, Rust's default (dlmalloc)
//! for the rest.
//!
//! A call lowers every string and list of its input through `cabi_realloc`, builds the ruleset
//! out of many small strings and vectors, and frees all of it when the host has read the
//! result: almost every allocation is small and short-lived. Free lists per power-of-two
//! size class make allocating and freeing them a handful of instructions. Freed small blocks
//! are kept for reuse (never returned to dlmalloc), so memory stays bounded by the peak of
//! live small blocks, as under dlmalloc; the host's memory limit applies unchanged.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;

/// Size classes 8, 16, ..., 1024 bytes.
const CLASSES: usize = 8;
const MAX_SMALL: usize = 8 << (CLASSES - 1);
/// Small blocks are carved from chunks of this size taken from dlmalloc.
const CHUNK: usize = 16 << 10;

pub struct Pool {
    state: UnsafeCell<State>,
}

struct State {
    free: [*mut u8; CLASSES],
    next: *mut u8,
    left: usize,
}

// SAFETY: a wasm32 guest instance runs on one thread; nothing here is shared across threads.
unsafe impl Sync for Pool {}

impl Pool {
    pub const fn new() -> Pool {
        Pool {
            state: UnsafeCell::new(State {
                free: [std::ptr::null_mut(); CLASSES],
                next: std::ptr::null_mut(),
                left: 0,
            }),
        }
    }
}

fn small(layout: &Layout) -> bool {
    layout.size() <= MAX_SMALL && layout.align() <= 8
}

fn class(size: usize) -> usize {
    (size.max(8).next_power_of_two().trailing_zeros() - 3) as usize
}

unsafe impl GlobalAlloc for Pool {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !small(&layout) {
            return unsafe { System.alloc(layout) };
        }
        let c = class(layout.size());
        // SAFETY: single-threaded (see `Sync`), and no allocator call re-enters this one.
        let state = unsafe { &mut *self.state.get() };
        let head = state.free[c];
        if !head.is_null() {
            // SAFETY: a free block holds the next free block's address in its first word.
            state.free[c] = unsafe { *(head as *mut *mut u8) };
            return head;
        }
        let size = 8 << c;
        if state.left < size {
            // The rest of the old chunk (less than one block) is left unused.
            let chunk = unsafe { System.alloc(Layout::from_size_align_unchecked(CHUNK, 8)) };
            if chunk.is_null() {
                return chunk;
            }
            state.next = chunk;
            state.left = CHUNK;
        }
        let block = state.next;
        state.next = unsafe { block.add(size) };
        state.left -= size;
        block
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !small(&layout) {
            return unsafe { System.dealloc(ptr, layout) };
        }
        let c = class(layout.size());
        let state = unsafe { &mut *self.state.get() };
        // SAFETY: the block is at least 8 bytes and 8-aligned, and now ours.
        unsafe { *(ptr as *mut *mut u8) = state.free[c] };
        state.free[c] = ptr;
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (small(&layout), small(&new_layout)) {
            (true, true) if class(layout.size()) == class(new_size) => ptr,
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            _ => {
                let new = unsafe { self.alloc(new_layout) };
                if !new.is_null() {
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                new
            }
        }
    }
}
